"""The images install the repository with `pip install .` and nothing else, so every
third-party module the package imports at run time must come with [project.dependencies]
(directly or through them). The dev extra is not in the images."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
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


@functools.cache
def installed_by_pip_install_dot() -> frozenset[str]:
    """Distributions `pip install .` brings: the dependencies and theirs, transitively."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        pending = [Requirement(r) for r in tomllib.load(handle)["project"]["dependencies"]]
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
def test_every_imported_module_is_installed_by_the_images(module: str) -> None:
    distributions = distributions_of().get(module, [])
    assert distributions, f"{module} (imported by {IMPORTS[module][0]}) is not installed here"
    installed = installed_by_pip_install_dot()
    assert any(_canonical(d) in installed for d in distributions), (
        f"{module} ({', '.join(distributions)}), imported by {sorted(set(IMPORTS[module]))}, "
        "does not come with [project.dependencies]: the images would fail to import it"
    )


def test_the_reader_sees_the_package_imports() -> None:
    assert {"kopf", "kubernetes", "torch", "pydantic", "prometheus_client"} <= set(IMPORTS)
