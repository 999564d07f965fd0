"""Turn a pydantic JSON schema into a Kubernetes structural schema.

A CRD schema must be *structural*: every node has a type, no `$ref`, no
`anyOf` of types, no `additionalProperties` next to `properties`. pydantic
writes JSON Schema 2020-12, so this module inlines `$defs`, folds
`Optional[X]` into X (an unset field is simply absent), drops titles, gives
integers their Kubernetes format, and puts keywords in a fixed order so the
generated YAML diffs cleanly. Anything it does not know is an error rather than
being passed through: an unexpected pydantic construct should fail generation,
not produce a CRD the API server reads differently.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from weightsync.api.base import INT32_MAX, INT64_MAX

Schema = dict[str, Any]

# Output order of keywords; also the set of keywords a generated schema may use.
KEYWORD_ORDER = (
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "maximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "items",
    "properties",
    "additionalProperties",
    "required",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-validations",
)
RULE_KEY_ORDER = ("rule", "message", "fieldPath", "reason")
# pydantic keywords with no place in a structural schema. `additionalProperties:
# false` is what extra="forbid" writes; the API server prunes or (with strict field
# validation) rejects unknown fields instead, and forbids the keyword next to
# `properties`. A map's (`dict[str, X]`) schema of X is kept: without it the API server
# would prune every key.
DROPPED_KEYWORDS = frozenset({"title"})


class SchemaError(ValueError):
    """The pydantic schema uses a construct this generator does not translate."""


def structural_schema(model: type[BaseModel], description: str) -> Schema:
    """The structural schema of `model`, described by `description` (the field's docstring)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    definitions: dict[str, Schema] = raw.pop("$defs", {})
    schema = _convert(raw, definitions, path=model.__name__)
    schema["description"] = _clean_description(description)
    return _ordered(schema)


def _resolve(node: Schema, definitions: dict[str, Schema], path: str) -> Schema:
    """`node` with `$ref`, single-item `allOf` and `Optional` unwrapped; siblings win."""
    node = dict(node)
    if "$ref" in node:
        target = definitions[node.pop("$ref").removeprefix("#/$defs/")]
        return {**_resolve(target, definitions, path), **node}
    if "allOf" in node:
        (only,) = node.pop("allOf")
        return {**_resolve(only, definitions, path), **node}
    if "anyOf" in node:
        variants = [variant for variant in node.pop("anyOf") if variant != {"type": "null"}]
        if len(variants) != 1:
            raise SchemaError(f"{path}: a union of several types is not structural")
        if node.get("default", ...) is None:
            del node["default"]
        return {**_resolve(variants[0], definitions, path), **node}
    return node


def _convert(node: Schema, definitions: dict[str, Schema], path: str) -> Schema:
    node = _resolve(node, definitions, path)
    result: Schema = {}
    for key, value in node.items():
        if key in DROPPED_KEYWORDS or (key == "additionalProperties" and value is False):
            continue
        if key not in KEYWORD_ORDER:
            raise SchemaError(f"{path}: keyword {key!r} has no structural translation")
        if key == "properties":
            result[key] = {
                name: _convert(child, definitions, f"{path}.{name}")
                for name, child in value.items()
            }
        elif key in ("items", "additionalProperties"):
            result[key] = _convert(value, definitions, f"{path}[]")
        elif key == "description":
            result[key] = _clean_description(value)
        elif key == "x-kubernetes-validations":
            # pydantic sorts the keys of schema extras; restore the reading order.
            result[key] = [
                {name: rule[name] for name in RULE_KEY_ORDER if name in rule} for rule in value
            ]
        else:
            result[key] = value
    if "type" not in result and not result.get("x-kubernetes-int-or-string"):
        # An int-or-string is the one node a structural schema leaves untyped.
        raise SchemaError(f"{path}: every node of a structural schema needs a type")
    if result.get("type") == "integer":
        _set_integer_format(result)
    return _ordered(result)


def _set_integer_format(node: Schema) -> None:
    """int32 when the bounds fit, else int64; a bound equal to the format's limit says nothing."""
    maximum = node.get("maximum", INT64_MAX)
    node["format"] = "int32" if maximum <= INT32_MAX else "int64"
    if maximum in (INT32_MAX, INT64_MAX):
        node.pop("maximum", None)


def _clean_description(text: str) -> str:
    """Docstrings wrap at the source's line length; the CRD wants one paragraph."""
    return " ".join(text.split())


def _ordered(node: Schema) -> Schema:
    return {key: node[key] for key in KEYWORD_ORDER if key in node}
