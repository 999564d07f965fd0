"""weightsync's images, built here from `images/*/Dockerfile` and imported into a node.

    python -m tests.cluster.images build [NAME ...]     # into buildah's storage
    python -m tests.cluster.images list                  # what is built, with sizes
    python -m tests.cluster.images prune                 # drop unused layers and bases

No registry is reachable, so nothing is pulled:

* **Base**: a Debian image of the host's release made by debootstrap (minimal variant plus
  Python and the libraries the images need), from the mirror the host's own apt uses,
  committed into buildah's storage and cached by its package list. It stands in for the
  production bases, which stay the Dockerfiles' defaults (`FROM ${...}` build arguments).
* **Dependencies** come from a wheelhouse downloaded on the host with the host's pip
  configuration (so its cache and index settings apply) and mounted into the build
  (`WHEELS`): builds need no network and bake no index or proxy into an image.
* **Builds** run the `buildah bud` of `make images` (`images.build.build_argv`) with the
  base and wheelhouse above as build arguments, in a storage of their own, with `--layers`
  (overlay storage, chroot isolation: crun fails on these hybrid cgroups), so a code
  change rebuilds only the project's own layer.
* **Import**: an image goes into a node's containerd once per build: it is pushed to a
  transient uncompressed OCI archive, imported, and the archive deleted; the import is
  tagged with the build's image ID, and `ensure_images` skips images already there.
  Stores: buildah's (the layer cache) and each node's containerd, never a third.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from images.build import SPECS, ImageBuildError, ImageSpec, build_argv

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync"))
STORAGE = CACHE_DIR / "buildah"
WHEELHOUSE = CACHE_DIR / "wheelhouse"
BUILDAH = (
    "buildah",
    "--root", str(STORAGE / "storage"),
    "--runroot", str(STORAGE / "run"),
    "--storage-driver", "overlay",
)  # fmt: skip
SUITE = "bookworm"
BASE_REPOSITORY = "weightsync.local/debian-base"
# Python for the venvs, and the libraries the agent's Mooncake transfer engine links.
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python-is-python3",
    "ca-certificates",
    "libibverbs1",
    "ibverbs-providers",
    "libnuma1",
    "libcurl4",
)
# The torch images' APT_PACKAGES in Debian's names (the default names Ubuntu's).
DEBIAN_APT_PACKAGES = "python3 python3-venv libibverbs1 ibverbs-providers libnuma1 libcurl4"


@dataclass(frozen=True, slots=True)
class ImageInfo:
    name: str
    ref: str
    image_id: str
    size_bytes: int


def log(message: str) -> None:
    print(f"[images] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def _run(argv: Sequence[str], *, timeout: float = 3600, **kwargs: object) -> str:
    result = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )  # type: ignore[call-overload]
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).splitlines()[-30:])
        raise ImageBuildError(f"{' '.join(argv[:4])} ... failed ({result.returncode}):\n{tail}")
    return str(result.stdout)


def buildah(*args: str, timeout: float = 3600, cwd: Path | None = None) -> str:
    return _run([*BUILDAH, *args], timeout=timeout, cwd=cwd)


def _digest(parts: Iterable[str | bytes]) -> str:
    sha = hashlib.sha256()
    for part in parts:
        sha.update(part.encode() if isinstance(part, str) else part)
        sha.update(b"\0")
    return sha.hexdigest()[:16]


def _image_id(ref: str) -> str | None:
    try:
        out = buildah("images", "--format", "{{.ID}}", "--no-trunc", ref)
    except ImageBuildError:
        return None
    return out.split()[0].removeprefix("sha256:") if out.strip() else None


def host_mirror() -> str:
    """The Debian mirror the host's apt uses (deb822 sources or the one-line format)."""
    candidates = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in candidates:
        for block in path.read_text().split("\n\n"):
            fields = dict(
                line.split(":", 1) for line in block.splitlines() if ":" in line and line[0] != "#"
            )
            suites = fields.get("Suites", "").split()
            if SUITE in suites and "security" not in fields.get("URIs", ""):
                return fields["URIs"].split()[0].strip()
    for path in (Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*.list")):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "deb" and SUITE in words:
                return next(w for w in words[1:] if "://" in w)
    raise ImageBuildError(f"no apt source for {SUITE} in /etc/apt: cannot debootstrap")


def base_image() -> str:
    """The local base image (debootstrap), built once per package list."""
    key = _digest([SUITE, *BASE_PACKAGES])
    ref = f"{BASE_REPOSITORY}:{SUITE}-{key}"
    if _image_id(ref):
        return ref
    log(f"debootstrap {SUITE} (minimal, {len(BASE_PACKAGES)} packages) for the base image")
    STORAGE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=STORAGE, prefix="debootstrap-") as scratch:
        root = Path(scratch) / "root"
        _run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             SUITE, str(root), host_mirror()],
            timeout=1800,
        )  # fmt: skip
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            _run(["find", str(root / leftover), "-type", "f", "-delete"])
        rootfs = Path(scratch) / "rootfs.tar"
        _run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(rootfs), "."])
        container = buildah("from", "scratch").strip()
        try:
            buildah("add", container, str(rootfs), "/")
            buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                    "/sbin:/bin", "--cmd", "/bin/bash", container)  # fmt: skip
            buildah("commit", "--rm", container, ref)
        except ImageBuildError:
            buildah("rm", container)
            raise
    for line in buildah("images", "--format", "{{.Name}}:{{.Tag}}").split():
        if line != ref and line.startswith(BASE_REPOSITORY):
            with contextlib.suppress(ImageBuildError):
                buildah("rmi", line)
    return ref


def wheelhouse(extra: str) -> Path:
    """Wheels of `extra`'s requirements and the build backend, downloaded by the host's pip."""
    requirements = _run([sys.executable, str(REPO_ROOT / "images" / "requirements.py"),
                         "--build", extra], cwd=REPO_ROOT).split()  # fmt: skip
    directory = WHEELHOUSE / f"{extra}-{_digest(requirements)}"
    if (directory / ".complete").exists():
        return directory
    log(f"pip download: {len(requirements)} requirements of [{extra}] into {directory}")
    directory.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
          "--dest", str(directory), *requirements], timeout=3600)  # fmt: skip
    (directory / ".complete").touch()
    for other in WHEELHOUSE.glob(f"{extra}-*"):
        if other != directory:
            _run(["rm", "-rf", str(other)])
    return directory


def build(spec: ImageSpec, *, context: Path = REPO_ROOT, ref: str | None = None) -> ImageInfo:
    """Build `spec` (layers cached) on the local base from the local wheelhouse, returning
    its image ID and size; from another tree laid out like this one (`context`) as `ref`."""
    ref = ref or spec.ref
    build_args = {
        spec.base_arg: base_image(),
        "WHEELS": "/wheels",
        "APT_PACKAGES": DEBIAN_APT_PACKAGES,  # the torch images' only
    }
    volume = f"{wheelhouse(spec.extra)}:/wheels:ro"
    options = ("--isolation", "chroot", "--volume", volume)
    started = time.monotonic()
    buildah(*build_argv(spec, ref, build_args, options), cwd=context)
    image_id = _image_id(ref)
    if image_id is None:
        raise ImageBuildError(f"{ref}: built, but buildah does not list it")
    size = _size_bytes(image_id)
    log(f"built {ref} ({image_id[:12]}) in {time.monotonic() - started:.0f}s")
    return ImageInfo(spec.name, ref, image_id, size)


def _size_bytes(image_id: str) -> int:
    """buildah's own (decimal, rounded) figure for the image's size."""
    units = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    for image in json.loads(buildah("images", "--json")):
        if image_id.startswith(image["id"]):
            number, unit = image["size"].split()
            return int(float(number) * units[unit])
    return 0


def _ctr(address: Path, namespace: str, *args: str, timeout: float = 1800) -> str:
    return _run(["ctr", "--address", str(address), "-n", namespace, *args], timeout=timeout)


def _normalized(ref: str) -> str:
    return ref if "." in ref.split("/", 1)[0] else f"docker.io/{ref}"


def import_image(info: ImageInfo, address: Path, namespace: str = "k8s.io") -> bool:
    """Import `info` into the containerd at `address` unless that build is there already;
    return whether it imported.

    The image goes in as buildah's own manifest (uncompressed layers, each named by its
    diff ID): compressing gigabytes of CUDA libraries would cost minutes, and a layer the
    store already holds (the torch layers, after any earlier import) is left out of the
    archive. A second image on the same layers is then a config and a manifest.
    """
    build_ref = _normalized(f"{info.ref.rsplit(':', 1)[0]}:build-{info.image_id[:16]}")
    present = _ctr(address, namespace, "images", "ls", "-q").split()
    if build_ref in present:
        if _normalized(info.ref) not in present or not _same(address, namespace, info, build_ref):
            _ctr(address, namespace, "images", "tag", "--force", build_ref, _normalized(info.ref))
        return False
    started = time.monotonic()
    image = json.loads(buildah("inspect", "--type", "image", info.ref))
    config, manifest = image["Config"].encode(), image["Manifest"].encode()
    held = {line.split()[0] for line in _ctr(address, namespace, "content", "ls").splitlines()[1:]}
    missing = [
        layer["digest"] for layer in json.loads(manifest)["layers"] if layer["digest"] not in held
    ]
    STORAGE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=STORAGE, prefix="export-") as scratch:
        exported = Path(scratch) / "image"
        if missing:  # buildah writes every layer to `dir:`; only the missing ones travel
            buildah("push", "--disable-compression", "--format", "oci", info.ref,
                    f"dir:{exported}")  # fmt: skip
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": json.loads(manifest)["mediaType"],
                    "digest": f"sha256:{hashlib.sha256(manifest).hexdigest()}",
                    "size": len(manifest),
                    "annotations": {"io.containerd.image.name": build_ref},
                }
            ],
        }
        blobs = {
            hashlib.sha256(config).hexdigest(): config,
            hashlib.sha256(manifest).hexdigest(): manifest,
        }
        files = {d.removeprefix("sha256:"): exported / d.removeprefix("sha256:") for d in missing}
        _stream_into(address, namespace, index, blobs, files)
    _ctr(address, namespace, "images", "tag", "--force", build_ref, _normalized(info.ref))
    log(
        f"imported {info.ref} in {time.monotonic() - started:.0f}s "
        f"({len(missing)} of {len(json.loads(manifest)['layers'])} layers sent)"
    )
    return True


def _stream_into(
    address: Path,
    namespace: str,
    index: dict[str, object],
    blobs: dict[str, bytes],
    files: dict[str, Path],
) -> None:
    """An OCI image layout, written as a tar straight into `ctr images import -`."""
    command = ["ctr", "--address", str(address), "-n", namespace, "images", "import", "-"]
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as ctr:
        if ctr.stdin is None or ctr.stdout is None:
            raise ImageBuildError("ctr's pipes did not open")
        with tarfile.open(fileobj=ctr.stdin, mode="w|") as tar:
            entries = {
                "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
                "index.json": json.dumps(index).encode(),
                **{f"blobs/sha256/{digest}": data for digest, data in blobs.items()},
            }
            for name, data in entries.items():
                entry = tarfile.TarInfo(name)
                entry.size = len(data)
                tar.addfile(entry, io.BytesIO(data))
            for digest, path in files.items():
                tar.add(path, arcname=f"blobs/sha256/{digest}")
        ctr.stdin.close()
        output = ctr.stdout.read().decode()
        if ctr.wait(timeout=1800) != 0:
            raise ImageBuildError(f"ctr images import failed:\n{output[-2000:]}")


def _same(address: Path, namespace: str, info: ImageInfo, build_ref: str) -> bool:
    listing = _ctr(address, namespace, "images", "ls")
    digests = {}
    for line in listing.splitlines()[1:]:
        words = line.split()
        if len(words) >= 3:
            digests[words[0]] = words[2]
    return digests.get(_normalized(info.ref)) == digests.get(build_ref)


def ensure_images(
    containerd_address: Path, namespace: str = "k8s.io", names: Sequence[str] | None = None
) -> dict[str, ImageInfo]:
    """Build (cached) and import (once per build) the named images, all by default."""
    found: dict[str, ImageInfo] = {}
    for name in names or list(SPECS):
        info = build(SPECS[name])
        import_image(info, containerd_address, namespace)
        found[name] = info
    prune()
    return found


def prune() -> None:
    """Drop what no current image needs: build containers left by interrupted builds, and
    every untagged image that is not a step of a tagged one's build (old builds, layers of
    an earlier pyproject.toml). The steps of current builds stay: they are the layer
    cache a code change rebuilds from."""
    for container in buildah("containers", "-q").split():
        buildah("rm", container)
    listed = json.loads(buildah("images", "--json") or "[]")
    chains: dict[str, list[str]] = {}
    for image in listed:
        inspected = json.loads(buildah("inspect", "--type", "image", image["id"]))
        chains[image["id"]] = inspected["OCIv1"]["rootfs"]["diff_ids"] or []
    current = [chains[i["id"]] for i in listed if i.get("names")]
    for image in listed:
        if image.get("names"):
            continue
        chain = chains[image["id"]]
        if not any(tagged[: len(chain)] == chain for tagged in current):
            with contextlib.suppress(ImageBuildError):  # a child of it may go first
                buildah("rmi", image["id"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("command", choices=["build", "list", "prune"])
    parser.add_argument("names", nargs="*", help=f"of {', '.join(SPECS)}; default all")
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(SPECS)
    if unknown:
        parser.error(f"unknown images {sorted(unknown)}; known: {', '.join(SPECS)}")
    if args.command == "build":
        for name in args.names or SPECS:
            info = build(SPECS[name])
            print(f"{info.ref}\t{info.image_id[:12]}\t{info.size_bytes / 1e9:.2f} GB")
        prune()
    elif args.command == "list":
        print(buildah("images"))
    else:
        prune()
    return 0


if __name__ == "__main__":
    sys.exit(main())
