"""Names and label values derived from a WeightSync fit Kubernetes' limits for any name."""

from __future__ import annotations

import re

import pytest

from weightsync.controller import names

LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@pytest.mark.parametrize(
    "name",
    ["sync", "a" * 63, "a" * 64, "x" * 253, "a.b-c" * 50 + "abc", "a" * 52 + "-" * 10 + "b" * 60],
)
def test_derived_names_and_labels_are_valid_for_any_weightsync_name(name: str) -> None:
    label = names.sync_label(name)
    assert len(label) <= 63
    assert LABEL_VALUE.match(label), label
    secret = names.token_secret_name(name)
    assert len(secret) <= 253
    assert SUBDOMAIN.match(secret), secret


def test_short_names_are_their_own_label_and_long_ones_differ_by_hash() -> None:
    assert names.sync_label("sync") == "sync"
    assert names.sync_label("a" * 63) == "a" * 63
    long_a, long_b = "a" * 100 + "x", "a" * 100 + "y"
    assert names.sync_label(long_a) != names.sync_label(long_b)
    assert names.sync_label(long_a) == names.sync_label(long_a)
