"""The scale harness's figures that are computed, not read."""

from __future__ import annotations

from tests.scale.harness import reclosed


def test_a_gate_closed_after_it_opened_counts_a_first_condition_does_not() -> None:
    changes = [
        (1.0, "new", "False"),  # its first condition: no flap
        (2.0, "new", "True"),
        (3.0, "old", "False"),  # open before the scale-up, closed: a flap
        (4.0, "new", "False"),  # opened, closed: a flap
        (5.0, "new", "False"),  # (a reason change: not recorded as a change, but harmless)
        (6.0, "new", "True"),
    ]
    assert reclosed(changes, {"old"}) == 2
