"""weightsync's images, built from `images/*/Dockerfile` with buildah and pushed where you say.

From the repository root (Python 3.11 or newer and buildah; no Docker engine, no virtualenv):

    python3 -m images.build                           # build all: weightsync/<name>:<version>
    python3 -m images.build --registry registry.example.com/team --tag 0.1.0   # and push
    python3 -m images.build --registry oci:/tmp/weightsync operator    # into an OCI layout

`make images REGISTRY=registry.example.com/team TAG=0.1.0` runs the second. An image goes to
`<registry>/weightsync/<name>:<tag>`, the chart's default repository under your prefix, and
the digest it was pushed as is printed with the `helm --set` flags that pin it.

The bases are the Dockerfiles' defaults (a Python slim image for the operator, nvidia/cuda's
base flavour for the torch images). Pin them by digest when publishing with
`--build-arg PYTHON_IMAGE=<image>:<tag>@sha256:<digest>` (and CUDA_IMAGE). The local test
cluster builds the same specs on a Debian base of its own (tests/cluster/images.py): that
substitution is the tests' concern and reaches the build only as build arguments.

Standard library only, so it runs before (and without) the project's virtualenv.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# buildah with its default storage; the test cluster passes its own (--root, --runroot).
BUILDAH: tuple[str, ...] = ("buildah",)
# `<registry>[:port]/path`, no transport: what `docker://` is followed by.
REGISTRY_PATH = re.compile(r"^[A-Za-z0-9.-]+(:\d+)?(/[a-z0-9._-]+)*$")
TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class ImageBuildError(RuntimeError):
    pass


def version() -> str:
    """The project's version: the chart's appVersion, so its default image tag."""
    with (REPO_ROOT / "pyproject.toml").open("rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


@dataclass(frozen=True, slots=True)
class ImageSpec:
    name: str
    dockerfile: str
    target: str | None
    base_arg: str  # the build argument that names its base image
    extra: str  # the pyproject.toml extra it installs

    @property
    def repository(self) -> str:
        return f"weightsync/{self.name}"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{version()}"

    def declares(self, arg: str) -> bool:
        dockerfile = (REPO_ROOT / self.dockerfile).read_text()
        return re.search(rf"^ARG\s+{re.escape(arg)}(=|\s|$)", dockerfile, re.MULTILINE) is not None


SPECS = {
    spec.name: spec
    for spec in (
        ImageSpec("operator", "images/operator/Dockerfile", None, "PYTHON_IMAGE", "operator"),
        ImageSpec("agent", "images/torch/Dockerfile", "agent", "CUDA_IMAGE", "agent"),
        ImageSpec(
            "reference-engine", "images/torch/Dockerfile", "reference-engine", "CUDA_IMAGE",
            "agent",
        ),
    )
}  # fmt: skip


def build_argv(
    spec: ImageSpec,
    ref: str,
    build_args: Mapping[str, str] | None = None,
    options: Sequence[str] = (),
) -> list[str]:
    """`buildah bud` arguments for `spec` tagged `ref`, run from the repository root: layers
    cached, and of `build_args` those that its Dockerfile declares (the torch images' and the
    operator's take different ones; an argument no one declares is a typo for the caller)."""
    argv = ["bud", "--layers", *options, "-f", spec.dockerfile, "-t", ref]
    if spec.target:
        argv += ["--target", spec.target]
    for name, value in (build_args or {}).items():
        if spec.declares(name):
            argv += ["--build-arg", f"{name}={value}"]
    return [*argv, "."]


def destination(registry: str, spec: ImageSpec, tag: str) -> str:
    """Where `buildah push` sends `spec`: `docker://<registry>/weightsync/<name>:<tag>` (a
    registry, the default), or with a transport prefix an OCI layout holding every image under
    that name (`oci:<dir>`) or a directory per image (`dir:<dir>`, then weightsync/<name>/<tag>),
    both for publishing without a registry (an air gap, a `skopeo copy` later) and for tests."""
    if not TAG.match(tag):
        raise ImageBuildError(f"{tag!r} is not a valid image tag")
    transport, _, path = registry.partition(":")
    if transport == "oci":
        if not path or ":" in path:  # the transport reads the path up to the first ':'
            raise ImageBuildError(f"{registry}: oci: takes a directory without ':' in it")
        return f"oci:{path.rstrip('/')}:{spec.repository}:{tag}"
    if transport == "dir":
        if not path:
            raise ImageBuildError(f"{registry}: dir: takes a directory")
        return f"dir:{path.rstrip('/')}/{spec.repository}/{tag}"
    prefix = registry.removeprefix("docker://").rstrip("/")
    if not REGISTRY_PATH.match(prefix):
        raise ImageBuildError(
            f"{registry}: expected a registry and path (registry.example.com/team), "
            "oci:<dir> or dir:<dir>"
        )
    return f"docker://{prefix}/{spec.repository}:{tag}"


def _buildah(buildah: Sequence[str], args: Sequence[str], cwd: Path | None = None) -> None:
    """Run buildah with its output on the terminal (a first build takes minutes)."""
    try:
        result = subprocess.run([*buildah, *args], cwd=cwd, check=False)
    except FileNotFoundError as error:
        raise ImageBuildError(f"{buildah[0]} is not installed (apt-get install buildah)") from error
    if result.returncode != 0:
        command = " ".join([*buildah, *args])
        raise ImageBuildError(f"`{command}` failed ({result.returncode})")


def push(ref: str, target: str, *, buildah: Sequence[str] = BUILDAH) -> str:
    """Push the local image `ref` to `target` (see `destination`); the manifest digest it was
    pushed as, the one that pins it."""
    transport, _, path = target.partition(":")
    if transport == "oci":  # buildah makes the last directory, not its parents
        Path(path.partition(":")[0]).parent.mkdir(parents=True, exist_ok=True)
    elif transport == "dir":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="weightsync-push-") as scratch:
        digest_file = Path(scratch) / "digest"
        _buildah(buildah, ["push", "--digestfile", str(digest_file), ref, target])
        return digest_file.read_text().strip()


@dataclass(frozen=True, slots=True)
class Published:
    name: str
    ref: str  # in local storage
    destination: str | None = None
    digest: str | None = None


def helm_flags(published: Sequence[Published]) -> list[str]:
    """The chart's values that install the pushed images pinned by digest (registries only)."""
    values = {"operator": "image", "agent": "agent.image"}
    flags = []
    for image in published:
        key = values.get(image.name)
        if key and image.digest and image.destination and image.destination.startswith("docker:"):
            repository = image.destination.removeprefix("docker://").rpartition(":")[0]
            flags += [f"--set {key}.repository={repository}", f"--set {key}.digest={image.digest}"]
    return flags


def publish(
    names: Sequence[str],
    tag: str,
    registry: str | None = None,
    build_args: Mapping[str, str] | None = None,
    *,
    buildah: Sequence[str] = BUILDAH,
) -> list[Published]:
    """Build `names` as weightsync/<name>:<tag> and, given a registry, push each as it is
    built. Everything is checked before the first build starts."""
    specs = [SPECS[name] for name in names]
    targets = {spec.name: destination(registry, spec, tag) for spec in specs} if registry else {}
    unused = [arg for arg in build_args or {} if not any(spec.declares(arg) for spec in specs)]
    if unused:
        raise ImageBuildError(f"no Dockerfile of {', '.join(names)} declares {', '.join(unused)}")
    published = []
    for spec in specs:
        ref = f"{spec.repository}:{tag}"
        _buildah(buildah, build_argv(spec, ref, build_args), cwd=REPO_ROOT)
        if spec.name in targets:
            digest = push(ref, targets[spec.name], buildah=buildah)
            published.append(Published(spec.name, ref, targets[spec.name], digest))
        else:
            published.append(Published(spec.name, ref))
    return published


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m images.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", help=f"of {', '.join(SPECS)}; default all")
    parser.add_argument(
        "--registry", help="push to <registry>/weightsync/<name>:<tag> (or oci:<dir>, dir:<dir>)"
    )
    parser.add_argument("--tag", default=version(), help="default: %(default)s (the chart's)")
    parser.add_argument(
        "--build-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="passed to the images whose Dockerfile declares NAME (PYTHON_IMAGE, CUDA_IMAGE)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(SPECS))
    if unknown:
        parser.error(f"unknown images {unknown}; known: {', '.join(SPECS)}")
    malformed = [a for a in args.build_arg if "=" not in a]
    if malformed:
        parser.error(f"--build-arg takes NAME=VALUE, not {', '.join(malformed)}")
    build_args = dict(a.split("=", 1) for a in args.build_arg)
    try:
        published = publish(args.names or list(SPECS), args.tag, args.registry, build_args)
    except ImageBuildError as error:
        print(f"images.build: {error}", file=sys.stderr)
        return 1
    for image in published:
        print(f"{image.destination}@{image.digest}" if image.destination else image.ref)
    flags = helm_flags(published)
    if flags:
        print("helm install ... " + " ".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
