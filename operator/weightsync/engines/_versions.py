"""How the HTTP adapters write weightsync versions into an engine's `weight_version`.

Engines keep `weight_version` as a free-form string ("default" until someone sets it).
weightsync writes its integer version as decimal digits. While an update is being loaded
it writes a marker instead, so an engine that loads in place and was left half-updated
says so itself, even after the agent that started the update has restarted.
"""

from __future__ import annotations

from dataclasses import dataclass

PARTIAL_PREFIX = "weightsync-partial-"


def served_label(version: int) -> str:
    return str(version)


def partial_label(version: int) -> str:
    return f"{PARTIAL_PREFIX}{version}"


@dataclass(frozen=True, slots=True)
class ParsedVersion:
    version: int | None  # the weightsync version served; None for anything else
    partial: bool  # a marker: an update was started and not finished


def parse_label(label: object) -> ParsedVersion:
    if isinstance(label, str):
        if label.isdigit():
            return ParsedVersion(version=int(label), partial=False)
        if label.startswith(PARTIAL_PREFIX):
            return ParsedVersion(version=None, partial=True)
    return ParsedVersion(version=None, partial=False)
