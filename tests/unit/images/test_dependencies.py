"""The images install the repository with `pip install '.[<extra>]'` and nothing else: the
operator image the `operator` extra, the agent and reference-engine images the `agent`
extra. So every third-party module a part of the package imports at run time must come
with [project.dependencies] plus that part's extra (directly or through them); the dev
extra is not in the images."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "operator" / "weightsync"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_imports() -> dict[str, list[str]]:
    """Top-level third-party modules imported by the package (not under TYPE_CHECKING)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("weightsync", "__future__"):
                    continue
                found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


# Which extra each subpackage's image installs (None: the base dependencies suffice; the
# client runs in the trainer's image, which installs `weightsync[client]`).
PART_EXTRAS: dict[str, str | None] = {
    "api": None,
    "controller": "operator",
    "agent": "agent",
    "transfer": "agent",
    "engines": "agent",
    "client": "client",
    "reference": "agent",
}


def extra_of(path: str) -> str | None:
    """The extra the image running `path` (a file of the package) installs."""
    parts = Path(path).relative_to("operator/weightsync").parts
    return PART_EXTRAS[parts[0]] if len(parts) > 1 else None


@functools.cache
def installed_by_pip_install(extra: str | None) -> frozenset[str]:
    """Distributions `pip install '.[extra]'` brings: the dependencies, the extra's, and
    theirs, transitively."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        project = tomllib.load(handle)["project"]
    wanted = project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])
    pending = [Requirement(r) for r in wanted]
    seen: set[str] = set()
    while pending:
        requirement = pending.pop()
        name = _canonical(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate()):
            continue
        seen.add(name)
        for child in importlib.metadata.requires(requirement.name) or []:
            parsed = Requirement(child)
            if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
                pending.append(parsed)
    return frozenset(seen)


@functools.cache
def distributions_of() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


IMPORTS = runtime_imports()


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_every_imported_module_is_installed_by_the_images_that_run_it(module: str) -> None:
    distributions = distributions_of().get(module, [])
    assert distributions, f"{module} (imported by {IMPORTS[module][0]}) is not installed here"
    for path in sorted(set(IMPORTS[module])):
        extra = extra_of(path)
        installed = installed_by_pip_install(extra)
        assert any(_canonical(d) in installed for d in distributions), (
            f"{module} ({', '.join(distributions)}), imported by {path}, does not come with"
            f" the dependencies plus the {extra!r} extra: its image would fail to import it"
        )


def test_the_operator_image_carries_no_torch_and_the_agent_image_no_kubernetes() -> None:
    assert "torch" not in installed_by_pip_install("operator")
    assert not {"kopf", "kubernetes"} & installed_by_pip_install("agent")


def test_the_reader_sees_the_package_imports() -> None:
    assert {"kopf", "kubernetes", "torch", "pydantic", "prometheus_client"} <= set(IMPORTS)


def test_the_client_imports_only_what_the_client_extra_installs() -> None:
    """A trainer installs `weightsync[client]` beside its own torch: everything importing
    `weightsync.client` loads (through `transfer`, `api`, ...) comes with it."""
    code = (
        "import sys, weightsync.client, weightsync.client.shards;"
        "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "operator")},
    )  # fmt: skip
    loaded = {m for m in done.stdout.split() if m not in sys.stdlib_module_names}
    third_party = {m: distributions_of()[m] for m in loaded if m in distributions_of()}
    assert "torch" in third_party
    assert "pydantic" in third_party
    installed = installed_by_pip_install("client")
    missing = {
        module: names
        for module, names in third_party.items()
        if module != "weightsync" and not any(_canonical(d) in installed for d in names)
    }
    assert missing == {}, f"the client loads modules its extra does not install: {missing}"
