"""The reconciler's soft state: which generations it delivered, and to whom."""

from __future__ import annotations

from tests.unit.controller.builders import agent
from weightsync.api.v1alpha1 import Role
from weightsync.controller.agents.view import AgentView
from weightsync.controller.membership.plan import Slot
from weightsync.controller.passes.memory import KEEP_DELIVERIES, Memory


def test_members_asked_before_a_delivery_are_unheard_about_it() -> None:
    memory = Memory()
    members = [Slot(0, "trainer-0", Role.SOURCE), Slot(1, "e-1", Role.SINK)]
    memory.delivered(7, members, at=10.0)
    memory.delivered(8, [*members, Slot(2, "e-2", Role.SINK)], at=20.0)
    view = AgentView()
    view.record({"trainer-0": agent("trainer-0", Role.SOURCE)}, {}, asked_at=15.0)
    view.record({"e-1": agent("e-1"), "e-2": agent("e-2")}, {}, asked_at=5.0)
    view.record({}, {"e-3": "TimeoutError"}, asked_at=5.0)  # no answer: nothing to count
    assert memory.unheard(view) == {7: {"e-1"}, 8: {"trainer-0", "e-1", "e-2"}}


def test_only_the_last_few_deliveries_are_kept_and_none_after_a_restart() -> None:
    memory = Memory()
    for generation in range(1, KEEP_DELIVERIES + 3):
        memory.delivered(generation, [Slot(0, "trainer-0", Role.SOURCE)], at=float(generation))
    assert sorted(memory.deliveries) == list(range(3, KEEP_DELIVERIES + 3))
    assert Memory().unheard(AgentView()) == {}
