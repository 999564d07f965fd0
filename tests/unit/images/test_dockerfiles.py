"""What can be checked of the images without a Docker engine: pins, user, entry point, install.

A small Dockerfile reader (line continuations, comments, ARG defaults in FROM, stages
named and built on) is enough for these files; each check says why it matters for the
image that gets built. tests/cluster/images.py builds them for real on the local node.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
# images/requirements.py runs inside the images (not a module of the package): load it.
_spec = importlib.util.spec_from_file_location("requirements", ROOT / "images" / "requirements.py")
assert _spec is not None
assert _spec.loader is not None
_requirements_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_requirements_module)
requirements = _requirements_module.requirements


@dataclass(frozen=True)
class Image:
    dockerfile: str
    target: str | None
    script: str  # the entry point, a console script of the package
    extra: str  # the part of the package it runs (pyproject.toml)


IMAGES = {
    "operator": Image("images/operator/Dockerfile", None, "weightsync-operator", "operator"),
    "agent": Image("images/torch/Dockerfile", "agent", "weightsync-agent", "agent"),
    "reference-engine": Image(
        "images/torch/Dockerfile", "reference-engine", "weightsync-reference-engine", "agent"
    ),
}
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# An exact version in the tag: at least major.minor.patch (python:3.12.12-slim-bookworm,
# nvidia/cuda:13.0.0-base-ubuntu24.04), never a moving tag such as `latest` or `3.12-slim`.
EXACT_TAG = re.compile(r"^\d+\.\d+\.\d+([.-][A-Za-z0-9.]+)*$")


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuations joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return result


def stages(path: Path) -> list[Stage]:
    args: dict[str, str] = {}
    found: list[Stage] = []
    for keyword, rest in instructions(path):
        if keyword == "ARG" and not found:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], parts[0])
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            found.append(Stage(image, name))
        else:
            assert found, f"{path}: {keyword} before FROM"
            found[-1].instructions.append((keyword, rest))
    return found


def chain(image: str) -> list[Stage]:
    """The stages an image's target is built from, base first (`FROM <stage>` followed)."""
    spec = IMAGES[image]
    built = stages(ROOT / spec.dockerfile)
    by_name = {s.name: s for s in built if s.name}
    stage = by_name[spec.target] if spec.target else built[-1]
    result = [stage]
    while stage.image in by_name:
        stage = by_name[stage.image]
        result.insert(0, stage)
    return result


def final_instructions(image: str) -> list[tuple[str, str]]:
    """What the image's own filesystem and config come from (its chain, base first)."""
    return [item for stage in chain(image) for item in stage.instructions]


def project_scripts() -> dict[str, str]:
    with (ROOT / "pyproject.toml").open("rb") as handle:
        scripts: dict[str, str] = tomllib.load(handle)["project"]["scripts"]
    return scripts


def repo_installs(commands: list[str]) -> list[tuple[str, frozenset[str], tuple[str, ...]]]:
    """Each `pip install` of the repository: (project path, extras, options that change
    what gets installed). Quietness, caching and editable mode change nothing installed."""
    cosmetic = {"-q", "--quiet", "--no-cache-dir", "-e", "--editable", "--upgrade", "-U"}
    found = []
    for command in commands:
        # `${WHEELS:+--no-index --find-links "$WHEELS"}` picks where packages come from
        # (a local wheelhouse or the index), not what gets installed.
        for part in re.split(r"&&|;", re.sub(r"\$\{\w+:\+[^}]*\}", "", command)):
            if "pip install" not in part:
                continue
            words = shlex.split(part)
            if len(words) < 2 or not words[0].endswith("pip") or words[1] != "install":
                continue
            options: list[str] = []
            requirements: list[str] = []
            rest = iter(words[2:])
            for word in rest:
                if word == "--cache-dir":
                    next(rest)
                elif word in cosmetic:
                    continue
                elif word.startswith("-"):
                    options.append(word)
                else:
                    requirements.append(word)
            for requirement in requirements:
                project, _, extras = requirement.partition("[")
                if project == ".":
                    found.append(
                        (
                            project,
                            frozenset(filter(None, extras.rstrip("]").split(","))),
                            tuple(options),
                        )
                    )
    return found


def ci_commands() -> list[str]:
    """Every command of .ci/setup (a shell script), continuations joined."""
    return (ROOT / ".ci" / "setup").read_text().replace("\\\n", " ").splitlines()


def run_commands(image: str) -> list[str]:
    return [rest for kw, rest in final_instructions(image) if kw == "RUN"] + [
        rest
        for stage in stages(ROOT / IMAGES[image].dockerfile)
        if stage.name and stage.name.startswith("build")
        for kw, rest in stage.instructions
        if kw == "RUN"
    ]


def test_every_dockerfile_builds_a_known_image() -> None:
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "images").glob("*/Dockerfile"))
    assert found == sorted({spec.dockerfile for spec in IMAGES.values()})


def test_the_torch_images_share_every_layer_but_their_entry_point() -> None:
    agent, engine = chain("agent"), chain("reference-engine")
    assert agent[:-1] == engine[:-1]
    for stage in (agent[-1], engine[-1]):
        assert {kw for kw, _ in stage.instructions} <= {"LABEL", "ENTRYPOINT", "ENV"}
    # The engine keeps what its GPUs' allocation sets; the sidecar, given no GPU of its
    # own, must not inherit the CUDA base's `all` (every GPU of the node).
    assert ("ENV", "NVIDIA_VISIBLE_DEVICES=void") in agent[-1].instructions
    assert not [i for i in engine[-1].instructions if i[0] == "ENV"]


@pytest.mark.parametrize("image", IMAGES)
def test_base_images_are_pinned(image: str) -> None:
    names = set()
    for stage in stages(ROOT / IMAGES[image].dockerfile):
        if stage.image in names:
            continue  # an earlier stage, not a registry image
        if stage.name:
            names.add(stage.name)
        reference, _, digest = stage.image.partition("@")
        repository, _, tag = reference.rpartition(":")
        assert repository, f"{image}: {stage.image} has no tag"
        assert EXACT_TAG.match(tag), f"{image}: {stage.image}: the tag is not an exact version"
        assert not digest or DIGEST.match(digest), f"{image}: malformed digest {digest}"


def test_the_operator_image_ships_only_the_venv_of_its_build_stage() -> None:
    built = stages(ROOT / IMAGES["operator"].dockerfile)
    build, final = built[0], built[-1]
    assert build.name
    copies = [rest for kw, rest in final.instructions if kw == "COPY"]
    assert copies == [f"--from={build.name} /opt/venv /opt/venv"]
    assert not any(kw == "RUN" and "pip install" in rest for kw, rest in final.instructions)


@pytest.mark.parametrize("image", IMAGES)
def test_the_build_context_has_what_the_dockerfile_copies(image: str) -> None:
    for stage in stages(ROOT / IMAGES[image].dockerfile):
        for keyword, rest in stage.instructions:
            if keyword != "COPY" or rest.startswith("--from"):
                continue
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"{image}: COPY {source}: not in the repository"


@pytest.mark.parametrize("image", IMAGES)
def test_runs_as_a_numeric_non_root_user(image: str) -> None:
    users = [rest for kw, rest in final_instructions(image) if kw == "USER"]
    if image == "operator":  # its final stage starts from the base again
        users = [rest for kw, rest in stages(ROOT / IMAGES[image].dockerfile)[-1].instructions
                 if kw == "USER"]  # fmt: skip
    assert users, f"{image}: the final stage sets no USER (it would run as root)"
    uid, _, gid = users[-1].partition(":")
    # Numeric, or the kubelet cannot check runAsNonRoot against the image.
    assert uid.isdigit(), f"{image}: USER {users[-1]} is not numeric"
    assert int(uid) != 0
    assert not gid or int(gid) != 0


def test_the_chart_runs_the_operator_as_the_images_user() -> None:
    values = yaml.safe_load((ROOT / "charts" / "weightsync" / "values.yaml").read_text())
    final = stages(ROOT / IMAGES["operator"].dockerfile)[-1]
    user = [rest for kw, rest in final.instructions if kw == "USER"][-1]
    context = values["podSecurityContext"]
    assert user == f"{context['runAsUser']}:{context['runAsGroup']}"


@pytest.mark.parametrize("image", IMAGES)
def test_entrypoint_is_a_console_script_of_the_package(image: str) -> None:
    script = IMAGES[image].script
    entrypoints = [rest for kw, rest in final_instructions(image) if kw == "ENTRYPOINT"]
    if image == "operator":
        final = stages(ROOT / IMAGES[image].dockerfile)[-1]
        entrypoints = [rest for kw, rest in final.instructions if kw == "ENTRYPOINT"]
    assert entrypoints[-1:] == [f'["{script}"]'], f"{image}: exec form, the console script only"
    scripts = project_scripts()
    assert script in scripts, f"{script} is not in pyproject.toml [project.scripts]"
    module, _, function = scripts[script].partition(":")
    assert importlib.util.find_spec(module) is not None, f"{scripts[script]}: no such module"
    assert function


@pytest.mark.parametrize("image", IMAGES)
def test_installs_its_extra_then_the_repository_without_dependencies(image: str) -> None:
    """Dependencies in a layer keyed by pyproject.toml (a code change rebuilds seconds),
    then the project with `--no-deps`: together what `pip install '.[<extra>]'` installs."""
    commands = run_commands(image)
    extra = IMAGES[image].extra
    resolved = [c for c in commands if f"requirements.py {extra} > requirements.txt" in c]
    assert len(resolved) == 1, f"{image}: the {extra} extra's requirements are not installed"
    assert "-r requirements.txt" in resolved[0]
    installs = repo_installs(commands)
    assert installs == [(".", frozenset(), ("--no-deps",))], installs
    order = [i for i, c in enumerate(commands) if c in resolved or "--no-deps" in c]
    assert order == sorted(order)
    # CI tests what every image runs: its dev extra brings each image's extra.
    with (ROOT / "pyproject.toml").open("rb") as handle:
        pyproject = tomllib.load(handle)
    assert set(requirements(pyproject, [extra])) <= set(requirements(pyproject, ["dev"]))
    ci = repo_installs(ci_commands())
    assert len(ci) == 1, f".ci/setup installs the repository {len(ci)} times"
    assert ci[0][1] == {"dev"}
