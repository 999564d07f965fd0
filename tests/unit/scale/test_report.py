"""The scale harness's figures that are computed, not read."""

from __future__ import annotations

from collections import Counter

from tests.scale.harness import reclosings


def test_a_gate_closed_after_it_opened_counts_a_first_condition_does_not() -> None:
    changes = [
        (1.0, "new", "False", "NotInRounds"),  # its first condition: no flap
        (2.0, "new", "True", "ServesCurrentVersion"),
        (3.0, "old", "False", "ContainersNotReady"),  # open before the scale-up: a flap
        (4.0, "new", "False", "NotInRounds"),  # opened, closed: a flap
        (5.0, "new", "False", "Behind"),  # a reason change while closed: no second flap
        (6.0, "new", "True", "ServesCurrentVersion"),
    ]
    assert reclosings(changes, {"old"}) == [
        (3.0, "old", "ContainersNotReady"),
        (4.0, "new", "NotInRounds"),
    ]
    moved = Counter(reason for _, _, reason in reclosings(changes, {"old"}, moved={"new"}))
    assert moved == {"ContainersNotReady": 1, "NotInRounds, moved": 1}
