"""values.yaml documents every key; values.schema.json closes every object."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.unit.chart.helm import CHART

VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_-]*):(?:\s|$)")


def documented_keys() -> dict[str, str]:
    """Every mapping key of values.yaml (dotted path) -> the comment block right above it."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in VALUES.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        if not stripped:
            comment = []
            continue
        match = _KEY.match(line)
        if match is None:  # a list item or a continuation: no key of its own
            comment = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(key for _, key in stack), match["key"]])
        stack.append((indent, match["key"]))
        found[path] = comment[0] if comment else ""
        comment = []
    return found


def mapping_keys(value: Any, prefix: str = "") -> set[str]:
    if not isinstance(value, dict):
        return set()
    keys = set()
    for key, child in value.items():
        path = f"{prefix}{key}"
        keys.add(path)
        keys |= mapping_keys(child, f"{path}.")
    return keys


def test_the_line_scanner_sees_every_key() -> None:
    assert set(documented_keys()) == mapping_keys(yaml.safe_load(VALUES.read_text()))


@pytest.mark.parametrize("path", sorted(documented_keys()))
def test_every_value_is_documented_by_a_comment_starting_with_its_name(path: str) -> None:
    comment = documented_keys()[path]
    assert comment.startswith(f"{path} "), f"{path}: comment above it is {comment!r}"


def _objects(node: Any, where: str = "#") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if isinstance(node, dict):
        if node.get("type") == "object":
            found.append((where, node))
        for key, child in node.items():
            found += _objects(child, f"{where}/{key}")
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found += _objects(child, f"{where}/{index}")
    return found


def test_every_object_in_the_schema_is_closed() -> None:
    """Objects with named properties forbid others; free-form maps type their values."""
    schema = json.loads(SCHEMA.read_text())
    objects = _objects(schema)
    assert len(objects) > 40
    for where, node in objects:
        assert "additionalProperties" in node, f"{where} has no additionalProperties"
        if "properties" in node:
            assert node["additionalProperties"] is False, f"{where} allows unknown keys"
        else:
            assert isinstance(node["additionalProperties"], dict), f"{where} is untyped"


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        return _resolve(schema, schema["definitions"][node["$ref"].rsplit("/", 1)[1]])
    return node


def _chart_keys(schema: dict[str, Any], node: dict[str, Any], prefix: str = "") -> set[str]:
    """Schema paths of the chart's own settings (not the Kubernetes types behind a $ref)."""
    keys = set()
    for key, child in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        keys.add(path)
        if "$ref" in child and _resolve(schema, child).get("properties") and key == "image":
            keys |= _chart_keys(schema, _resolve(schema, child), f"{path}.")
        elif "$ref" not in child:
            keys |= _chart_keys(schema, child, f"{path}.")
    return keys


def test_every_schema_setting_has_a_default_in_values_yaml() -> None:
    schema = json.loads(SCHEMA.read_text())
    values = mapping_keys(yaml.safe_load(VALUES.read_text()))
    missing = _chart_keys(schema, schema) - values
    assert not missing, f"in the schema but without a documented default: {sorted(missing)}"
