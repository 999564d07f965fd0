"""Agent tokens are derived: the same WeightSync (re-created included) gets the same token."""

from __future__ import annotations

from weightsync.controller.cluster.tokens import derive


def test_tokens_are_stable_per_weightsync_and_differ_between_them() -> None:
    key = bytes(range(32))
    token = derive(key, "rl", "sync")
    assert token == derive(key, "rl", "sync")  # deleted and created again: same token
    assert len(token) == 43
    assert token != derive(key, "rl", "other")
    assert token != derive(key, "rl2", "sync")
    assert token != derive(bytes(32), "rl", "sync")  # another operator key
