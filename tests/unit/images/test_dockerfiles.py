"""What can be checked of the images without a Docker engine: pins, user, entry point, install.

A small Dockerfile reader (line continuations, comments, ARG defaults in FROM) is
enough for these files; each check says why it matters for the image that gets built.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
IMAGES = {
    "operator": "weightsync-operator",
    "agent": "weightsync-agent",
    "reference-engine": "weightsync-reference-engine",
}
# The extra each image installs: the part of the package it runs (pyproject.toml).
EXTRAS = {"operator": "operator", "agent": "agent", "reference-engine": "agent"}
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


def dockerfile(image: str) -> Path:
    return ROOT / "images" / image / "Dockerfile"


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
        for part in re.split(r"&&|;", command):
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
    return [
        rest
        for stage in stages(dockerfile(image))
        for kw, rest in stage.instructions
        if kw == "RUN"
    ]


def test_every_image_has_a_dockerfile() -> None:
    assert sorted(p.parent.name for p in (ROOT / "images").glob("*/Dockerfile")) == sorted(IMAGES)


@pytest.mark.parametrize("image", IMAGES)
def test_base_images_are_pinned(image: str) -> None:
    names = set()
    for stage in stages(dockerfile(image)):
        if stage.image in names:
            continue  # an earlier stage, not a registry image
        if stage.name:
            names.add(stage.name)
        reference, _, digest = stage.image.partition("@")
        repository, _, tag = reference.rpartition(":")
        assert repository, f"{image}: {stage.image} has no tag"
        assert EXACT_TAG.match(tag), f"{image}: {stage.image}: the tag is not an exact version"
        assert not digest or DIGEST.match(digest), f"{image}: malformed digest {digest}"


@pytest.mark.parametrize("image", IMAGES)
def test_builds_in_stages_and_ships_only_the_venv(image: str) -> None:
    built = stages(dockerfile(image))
    assert len(built) >= 2
    build, final = built[0], built[-1]
    assert build.name
    copies = [rest for kw, rest in final.instructions if kw == "COPY"]
    assert copies == [f"--from={build.name} /opt/venv /opt/venv"]
    assert not any(kw == "RUN" and "pip install" in rest for kw, rest in final.instructions)


@pytest.mark.parametrize("image", IMAGES)
def test_the_build_context_has_what_the_dockerfile_copies(image: str) -> None:
    for stage in stages(dockerfile(image)):
        for keyword, rest in stage.instructions:
            if keyword != "COPY" or rest.startswith("--from"):
                continue
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"{image}: COPY {source}: not in the repository"


@pytest.mark.parametrize("image", IMAGES)
def test_runs_as_a_numeric_non_root_user(image: str) -> None:
    final = stages(dockerfile(image))[-1]
    users = [rest for kw, rest in final.instructions if kw == "USER"]
    assert users, f"{image}: the final stage sets no USER (it would run as root)"
    uid, _, gid = users[-1].partition(":")
    # Numeric, or the kubelet cannot check runAsNonRoot against the image.
    assert uid.isdigit(), f"{image}: USER {users[-1]} is not numeric"
    assert int(uid) != 0
    assert not gid or int(gid) != 0


def test_the_chart_runs_the_operator_as_the_images_user() -> None:
    values = yaml.safe_load((ROOT / "charts" / "weightsync" / "values.yaml").read_text())
    final = stages(dockerfile("operator"))[-1]
    user = [rest for kw, rest in final.instructions if kw == "USER"][-1]
    context = values["podSecurityContext"]
    assert user == f"{context['runAsUser']}:{context['runAsGroup']}"


@pytest.mark.parametrize(("image", "script"), IMAGES.items())
def test_entrypoint_is_a_console_script_of_the_package(image: str, script: str) -> None:
    import importlib.util

    final = stages(dockerfile(image))[-1]
    entrypoints = [rest for kw, rest in final.instructions if kw == "ENTRYPOINT"]
    assert entrypoints == [f'["{script}"]'], f"{image}: exec form, the console script only"
    scripts = project_scripts()
    assert script in scripts, f"{script} is not in pyproject.toml [project.scripts]"
    module, _, function = scripts[script].partition(":")
    assert importlib.util.find_spec(module) is not None, f"{scripts[script]}: no such module"
    assert function


@pytest.mark.parametrize("image", IMAGES)
def test_installs_the_repository_as_ci_does_with_its_own_extra(image: str) -> None:
    ci = repo_installs(ci_commands())
    assert len(ci) == 1, f".ci/setup installs the repository {len(ci)} times"
    project, ci_extras, ci_options = ci[0]
    assert ci_extras == {"dev"}
    installs = repo_installs(run_commands(image))
    assert len(installs) == 1, f"{image}: {len(installs)} pip installs of the repository"
    assert installs[0] == (project, frozenset({EXTRAS[image]}), ci_options)
    # CI tests what every image runs: its dev extra brings each image's extra.
    with (ROOT / "pyproject.toml").open("rb") as handle:
        dev = tomllib.load(handle)["project"]["optional-dependencies"]["dev"]
    (itself,) = [r for r in dev if r.startswith("weightsync[")]
    assert EXTRAS[image] in itself.removeprefix("weightsync[").removesuffix("]").split(",")
