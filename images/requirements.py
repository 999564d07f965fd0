"""Print the requirements of weightsync's given extras, one per line, from pyproject.toml.

The images install these in a layer of their own before the project's code, so a code
change rebuilds seconds of layers, not torch's minutes:

    python3 images/requirements.py agent > requirements.txt
    python3 images/requirements.py --build agent   # and the build backend's own

Standard library only: it runs in a bare base image before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

SELF = re.compile(r"^weightsync\[(?P<extras>[^\]]+)\]$")


def requirements(pyproject: dict[str, object], extras: list[str]) -> list[str]:
    project = pyproject["project"]
    assert isinstance(project, dict)
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    found: list[str] = list(project.get("dependencies", []))
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r}")
        seen.add(extra)
        for requirement in optional[extra]:
            match = SELF.match(requirement.replace(" ", ""))
            if match:
                pending.extend(match["extras"].split(","))
            elif requirement not in found:
                found.append(requirement)
    return found


def main(argv: list[str]) -> int:
    build = "--build" in argv
    extras = [a for a in argv if a != "--build"]
    here = Path(__file__).resolve().parent
    path = next(p for p in (Path("pyproject.toml"), here.parent / "pyproject.toml") if p.exists())
    pyproject = tomllib.loads(path.read_text())
    lines = requirements(pyproject, extras)
    if build:
        lines += pyproject["build-system"]["requires"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
