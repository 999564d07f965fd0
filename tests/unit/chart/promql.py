"""Which metric names a PromQL expression reads: a small tokenizer, enough for our queries.

Skips string literals, range and subquery brackets, label matchers in braces, the label
lists of `by`/`without`/`on`/`ignoring`/`group_left`/`group_right`, function and
aggregation names, keywords and numbers. What remains are metric names.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<bracket>\[[^\]]*\])
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)(?:ms|[smhdwy])?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<punct>=~|!~|!=|==|<=|>=|[(){},=<>+\-*/%^@])
  | (?P<space>\s+)
    """,
    re.VERBOSE,
)

AGGREGATIONS = frozenset(
    {
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    }
)  # fmt: skip
LABEL_LIST_KEYWORDS = frozenset(["by", "without", "on", "ignoring", "group_left", "group_right"])
KEYWORDS = LABEL_LIST_KEYWORDS | {"bool", "and", "or", "unless", "offset", "atan2", "inf", "nan"}


class PromQLSyntaxError(ValueError):
    """The tokenizer met a character no PromQL token starts with."""


def tokens(expr: str) -> list[tuple[str, str]]:
    result = []
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise PromQLSyntaxError(f"unexpected {expr[position : position + 20]!r} in {expr!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            result.append((kind, match.group()))
        position = match.end()
    return result


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects."""
    found: set[str] = set()
    items = tokens(expr)
    depth_braces = 0
    skip_label_list = False  # the next ( ... ) is a label list
    in_label_list = 0
    for index, (kind, text) in enumerate(items):
        following = items[index + 1][1] if index + 1 < len(items) else ""
        if kind == "punct":
            if text == "{":
                depth_braces += 1
            elif text == "}":
                depth_braces -= 1
            elif text == "(" and skip_label_list:
                skip_label_list = False
                in_label_list = 1
            elif text == "(" and in_label_list:
                in_label_list += 1
            elif text == ")" and in_label_list:
                in_label_list -= 1
            continue
        if kind != "ident" or depth_braces or in_label_list:
            continue
        if text in LABEL_LIST_KEYWORDS:
            skip_label_list = following == "("
            continue
        if text in KEYWORDS or text in AGGREGATIONS or following == "(":
            continue
        found.add(text)
    return found
