"""`make images` (images/build.py): the buildah commands it runs and where it pushes, with a
stand-in for buildah; and the install docs it is described in, against the repository.

tests/cluster/test_images.py pushes a real image through the same code.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from images.build import (
    SPECS,
    ImageBuildError,
    Published,
    build_argv,
    destination,
    helm_flags,
    publish,
)

ROOT = Path(__file__).resolve().parents[3]
IMAGE_DOCS = ("docs/install.md", "docs/real-cluster.md")
# buildah's stand-in: logs each call; a push writes a digest where --digestfile says.
FAKE_BUILDAH = (
    "sh",
    "-c",
    'echo "$*" >> "$BUILDAH_LOG"; if [ "$1" = push ]; then echo sha256:feed > "$3"; fi',
    "buildah",
)


def dockerfile_default(spec_name: str) -> str:
    spec = SPECS[spec_name]
    text = (ROOT / spec.dockerfile).read_text()
    match = re.search(rf"^ARG {spec.base_arg}=(\S+)$", text, re.MULTILINE)
    assert match, f"{spec.dockerfile} has no default for {spec.base_arg}"
    return match[1]


@pytest.mark.parametrize("name", SPECS)
def test_a_users_build_keeps_the_dockerfiles_bases(name: str) -> None:
    """Nothing is substituted unless asked: the production bases are the Dockerfiles'."""
    spec = SPECS[name]
    argv = build_argv(spec, f"weightsync/{name}:1.2.3")
    assert "--build-arg" not in argv
    assert argv[:2] == ["bud", "--layers"]
    assert argv[-1] == "."
    assert argv[argv.index("-f") + 1] == spec.dockerfile
    assert argv[argv.index("-t") + 1] == f"weightsync/{name}:1.2.3"
    assert ("--target" in argv) == (spec.target is not None)
    assert dockerfile_default(name).startswith(
        "nvidia/cuda:" if spec.base_arg == "CUDA_IMAGE" else "python:"
    )


def test_build_arguments_reach_only_the_images_that_declare_them() -> None:
    pins = {"PYTHON_IMAGE": "python@sha256:1", "CUDA_IMAGE": "cuda@sha256:2"}
    operator = build_argv(SPECS["operator"], "o", pins)
    agent = build_argv(SPECS["agent"], "a", pins)
    assert "PYTHON_IMAGE=python@sha256:1" in operator
    assert "CUDA_IMAGE=cuda@sha256:2" not in operator
    assert "CUDA_IMAGE=cuda@sha256:2" in agent
    assert "PYTHON_IMAGE=python@sha256:1" not in agent


@pytest.mark.parametrize(
    ("registry", "expected"),
    [
        ("registry.example.com/team", "docker://registry.example.com/team/weightsync/agent:1.2.3"),
        ("registry.example.com:5000/", "docker://registry.example.com:5000/weightsync/agent:1.2.3"),
        ("docker://registry.example.com", "docker://registry.example.com/weightsync/agent:1.2.3"),
        ("oci:/srv/images/", "oci:/srv/images:weightsync/agent:1.2.3"),
        ("dir:/srv/images", "dir:/srv/images/weightsync/agent/1.2.3"),
    ],
)
def test_destination(registry: str, expected: str) -> None:
    assert destination(registry, SPECS["agent"], "1.2.3") == expected


@pytest.mark.parametrize(
    ("registry", "tag"),
    [
        ("oci:", "1.2.3"),
        ("oci:/srv/a:b", "1.2.3"),  # the oci transport's path ends at the first ':'
        ("dir:", "1.2.3"),
        ("https://registry.example.com", "1.2.3"),
        ("docker-archive:/srv/a.tar", "1.2.3"),
        ("registry.example.com/Team", "1.2.3"),
        ("registry.example.com/team", "1.2.3/x"),
        ("registry.example.com/team", ""),
    ],
)
def test_destination_refuses(registry: str, tag: str) -> None:
    with pytest.raises(ImageBuildError):
        destination(registry, SPECS["agent"], tag)


def test_publish_builds_and_pushes_each_image_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "buildah.log"
    monkeypatch.setenv("BUILDAH_LOG", str(log))
    published = publish(
        ["operator", "agent"],
        "1.2.3",
        "registry.example.com/team",
        {"CUDA_IMAGE": "cuda@sha256:2"},
        buildah=FAKE_BUILDAH,
    )
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [call[0] for call in calls] == ["bud", "push", "bud", "push"]
    assert calls[0] == build_argv(SPECS["operator"], "weightsync/operator:1.2.3")
    assert "CUDA_IMAGE=cuda@sha256:2" in calls[2]
    assert calls[3][-2:] == [
        "weightsync/agent:1.2.3",
        "docker://registry.example.com/team/weightsync/agent:1.2.3",
    ]
    assert [p.digest for p in published] == ["sha256:feed", "sha256:feed"]
    assert helm_flags(published) == [
        "--set image.repository=registry.example.com/team/weightsync/operator",
        "--set image.digest=sha256:feed",
        "--set agent.image.repository=registry.example.com/team/weightsync/agent",
        "--set agent.image.digest=sha256:feed",
    ]


def test_publish_only_builds_without_a_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "buildah.log"
    monkeypatch.setenv("BUILDAH_LOG", str(log))
    published = publish(["reference-engine"], "1.2.3", buildah=FAKE_BUILDAH)
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["bud"]
    assert published == [Published("reference-engine", "weightsync/reference-engine:1.2.3")]
    assert helm_flags(published) == []


@pytest.mark.parametrize(
    ("registry", "build_args"),
    [("registry.example.com/team", {"CUDA_IMAGE": "x"}), ("https://x", {})],
)
def test_publish_checks_everything_before_it_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: str, build_args: dict[str, str]
) -> None:
    """A typo must not cost a build: the operator declares no CUDA_IMAGE."""
    log = tmp_path / "buildah.log"
    monkeypatch.setenv("BUILDAH_LOG", str(log))
    with pytest.raises(ImageBuildError):
        publish(["operator"], "1.2.3", registry, build_args, buildah=FAKE_BUILDAH)
    assert not log.exists()


def test_make_images_runs_the_module_with_the_users_settings() -> None:
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "images", "REGISTRY=registry.example.com/team",
         "TAG=0.1.0", "CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04@sha256:1"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    command = " ".join(dry.stdout.replace("\\\n", " ").split())
    assert command == (
        "python3 -m images.build --registry 'registry.example.com/team' --tag '0.1.0' "
        "--build-arg 'CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04@sha256:1'"
    )


@pytest.mark.parametrize("doc", IMAGE_DOCS)
def test_the_install_docs_name_what_exists(doc: str) -> None:
    """Every repository path, `make` target and base image they name is there."""
    text = (ROOT / doc).read_text()
    paths = re.findall(r"(?<![\w./<>-])(?:images|charts|crds|tests|docs|operator)/[\w./-]*", text)
    missing = [p for p in paths if not (ROOT / p.rstrip(".")).exists()]
    assert not missing, f"{doc} names paths that do not exist: {missing}"
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    named = set(re.findall(r"\bmake ([\w-]+)", text))
    assert named <= targets, f"{doc}: no such make targets {named - targets}"
    bases = {dockerfile_default(name) for name in SPECS}
    for named_base in re.findall(r"\b(?:python|nvidia/cuda):[\w.-]+", text):
        assert named_base in bases, f"{doc}: {named_base} is not a Dockerfile's default base"
