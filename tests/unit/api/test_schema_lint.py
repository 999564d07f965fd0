"""API-convention lint over the generated CRD schema.

The Kubernetes API conventions this project holds itself to, checked on every
node of the generated `openAPIV3Schema`, so a new field that breaks one fails
here instead of in review. Each rule is also run against a schema that breaks
it, to prove the lint can fail.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest

from weightsync.api.crd import openapi_schema

Schema = dict[str, Any]

DURATION_WORDS = re.compile(r"(timeout|duration|interval|period|delay|backoff|ttl|latency)", re.I)
DURATION_UNITS = ("Seconds", "Millis", "Minutes")
CAMEL_CASE_VALUE = re.compile(r"^[A-Z][A-Za-z0-9]*$")


def walk(schema: Schema, path: str = "") -> Iterator[tuple[str, str, Schema]]:
    """(path, property name, node) for every node; the root's name is ""."""
    yield path, path.rsplit(".", 1)[-1].removesuffix("[]"), schema
    for name, child in schema.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}" if path else name)
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")


def lint(schema: Schema) -> list[str]:
    """Every breach of the conventions in `schema`, as "path: what" lines."""
    problems: list[str] = []
    for path, name, node in walk(schema):
        problems.extend(f"{path}: {problem}" for problem in _lint_types(node))
        problems.extend(f"{path}: {problem}" for problem in _lint_naming(path, name, node))
    problems.extend(_lint_conditions(schema))
    return problems


def _lint_types(node: Schema) -> Iterator[str]:
    kind = node.get("type")
    if kind is None and not node.get("x-kubernetes-int-or-string"):
        yield "no type (not structural)"
    if kind == "number":
        yield "floating-point type; use integers with a unit"
    if kind == "integer" and node.get("format") not in ("int32", "int64"):
        yield "integer without int32/int64 format"
    if {"$ref", "title", "anyOf", "oneOf", "allOf"} & node.keys():
        yield "$ref, title or a combinator left in the schema"
    if kind == "array" and "maxItems" not in node:
        yield "list without maxItems"
    if kind == "array" and "x-kubernetes-list-type" not in node:
        yield "list without x-kubernetes-list-type"
    yield from (
        f"enum value {value!r} is not CamelCase"
        for value in node.get("enum", [])
        if not CAMEL_CASE_VALUE.match(str(value))
    )
    yield from (
        f"CEL rule {rule['rule']!r} without a message"
        for rule in node.get("x-kubernetes-validations", [])
        if not rule.get("message")
    )


def _lint_naming(path: str, name: str, node: Schema) -> Iterator[str]:
    if name.lower() in ("phase", "state"):
        yield f"{name} field; report conditions instead"
    # Properties need descriptions; the root, list items and metadata (where the API
    # server forbids any schema but its type) are exempt.
    if path not in ("", "metadata") and not path.endswith("[]"):
        description = node.get("description", "")
        if not description:
            yield "no description"
        elif not description.startswith(f"{name} "):
            yield f"description does not start with {name!r}"
    if DURATION_WORDS.search(name) and not name.endswith(DURATION_UNITS):
        yield f"duration without a unit suffix {DURATION_UNITS}"
    if name.endswith(DURATION_UNITS) and node.get("type") != "integer":
        yield "duration that is not an integer"
    if name.endswith("Time") and node.get("format") != "date-time":
        yield "a *Time field is a date-time timestamp"


def _lint_conditions(schema: Schema) -> list[str]:
    status = schema.get("properties", {}).get("status", {})
    properties = list(status.get("properties", {}))
    if not properties or properties[0] != "conditions":
        return ["status.conditions: missing or not the first status field"]
    conditions = status["properties"]["conditions"]
    problems = []
    if conditions.get("x-kubernetes-list-type") != "map":
        problems.append("status.conditions: not x-kubernetes-list-type: map")
    if conditions.get("x-kubernetes-list-map-keys") != ["type"]:
        problems.append("status.conditions: not keyed by type")
    item = conditions.get("items", {}).get("properties", {})
    expected = ["type", "status", "observedGeneration", "lastTransitionTime", "reason", "message"]
    if sorted(item) != sorted(expected):
        problems.append(f"status.conditions[]: fields {sorted(item)}, want {sorted(expected)}")
    return problems


def test_generated_schema_follows_the_conventions() -> None:
    assert lint(openapi_schema()) == []


def _breach(mutate: Any) -> list[str]:
    schema = copy.deepcopy(openapi_schema())
    mutate(schema)
    return lint(schema)


def _spec(schema: Schema) -> Schema:
    properties: Schema = schema["properties"]["spec"]["properties"]
    return properties


def _status(schema: Schema) -> Schema:
    properties: Schema = schema["properties"]["status"]["properties"]
    return properties


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        pytest.param(
            lambda s: _status(s).__setitem__(
                "phase", {"description": "phase is a state machine", "type": "string"}
            ),
            "status.phase: phase field",
            id="phase",
        ),
        pytest.param(
            lambda s: _status(s)["lastRound"]["properties"].__setitem__(
                "gbps", {"description": "gbps is fast", "type": "number"}
            ),
            "status.lastRound.gbps: floating-point type",
            id="float",
        ),
        pytest.param(
            lambda s: _spec(s)["transfer"]["properties"].__setitem__(
                "timeout", {"description": "timeout is long", "type": "integer", "format": "int32"}
            ),
            "spec.transfer.timeout: duration without a unit suffix",
            id="duration-without-unit",
        ),
        pytest.param(
            lambda s: _spec(s)["transfer"]["properties"]["checksum"].pop("description"),
            "spec.transfer.checksum: no description",
            id="no-description",
        ),
        pytest.param(
            lambda s: _spec(s)["transfer"]["properties"]["checksum"].__setitem__(
                "description", "Whether to checksum."
            ),
            "spec.transfer.checksum: description does not start with 'checksum'",
            id="description-without-name",
        ),
        pytest.param(
            lambda s: _status(s)["conditions"].__setitem__("x-kubernetes-list-type", "atomic"),
            "status.conditions: not x-kubernetes-list-type: map",
            id="conditions-not-list-map",
        ),
        pytest.param(
            lambda s: _status(s)["conditions"].__setitem__(
                "x-kubernetes-list-map-keys", ["reason"]
            ),
            "status.conditions: not keyed by type",
            id="conditions-not-keyed-by-type",
        ),
        pytest.param(
            lambda s: s["properties"]["status"].__setitem__(
                "properties", dict(reversed(list(_status(s).items())))
            ),
            "status.conditions: missing or not the first status field",
            id="conditions-not-first",
        ),
        pytest.param(
            lambda s: _spec(s)["inference"].pop("maxItems"),
            "spec.inference: list without maxItems",
            id="list-without-max-items",
        ),
        pytest.param(
            lambda s: _spec(s)["mode"].__setitem__("enum", ["disaggregated", "Colocated"]),
            "spec.mode: enum value 'disaggregated' is not CamelCase",
            id="enum-not-camel-case",
        ),
        pytest.param(
            lambda s: _spec(s)["transfer"]["properties"]["pipelineDepth"].pop("format"),
            "spec.transfer.pipelineDepth: integer without int32/int64 format",
            id="integer-without-format",
        ),
        pytest.param(
            lambda s: _status(s)["lastRound"]["properties"]["completionTime"].pop("format"),
            "status.lastRound.completionTime: a *Time field is a date-time timestamp",
            id="time-not-timestamp",
        ),
    ],
)
def test_lint_catches(mutate: Any, expected: str) -> None:
    problems = _breach(mutate)
    assert any(problem.startswith(expected) for problem in problems), problems
