"""JSON patch (RFC 6902) building blocks for the pod webhook: adds that work whether or
not the parent map or list exists yet (an `add` to a missing parent fails the patch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

JsonPatch = list[dict[str, Any]]


def escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def add_to_map(ops: JsonPatch, parent: Mapping[str, Any], path: str, items: dict[str, str]) -> None:
    key = path.rsplit("/", 1)[1]
    if key not in parent or parent[key] is None:
        ops.append({"op": "add", "path": path, "value": dict(items)})
        return
    for name, value in items.items():
        ops.append({"op": "add", "path": f"{path}/{escape(name)}", "value": value})


def append_to(ops: JsonPatch, parent: Mapping[str, Any], path: str, values: Sequence[Any]) -> None:
    if not values:
        return
    key = path.rsplit("/", 1)[1]
    if not parent.get(key):
        ops.append({"op": "add", "path": path, "value": list(values)})
        return
    ops.extend({"op": "add", "path": f"{path}/-", "value": value} for value in values)
