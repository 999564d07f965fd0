"""The pre-warm timeout: cold members sit out once, then the group is planned anew."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.unit.controller.builders import agent, sink_view, source_view, sync
from weightsync.api.control import AgentStatus, GenerationState
from weightsync.api.v1alpha1 import Role, WeightSyncStatus
from weightsync.controller.membership.plan import Slot, desired_members, needs_new_generation, slots
from weightsync.controller.passes.generations import Planned, Planner, Stored
from weightsync.controller.passes.memory import Memory
from weightsync.controller.settings import OperatorSettings

B, A, F = GenerationState.BROKEN, GenerationState.ACTIVE, GenerationState.FORMING
TIMEOUT = 60


def test_all_sinks_cold_at_the_timeout_sit_out_once_then_the_group_is_planned_anew() -> None:
    """The chaos matrix's stuck operator: every sink's agent reported the planned
    generation broken past its pre-warm timeout, so every sink sat out; with no sink no
    group was formable, so no new generation was planned, so the next pass found the
    same generation timed out and benched the sinks again, for good."""
    spec = sync(spec__prewarm__timeoutSeconds=TIMEOUT).spec
    pods = [source_view(), sink_view("e-1"), sink_view("e-2", ip="10.0.1.2")]
    answering = {p.name for p in pods}
    planned = list(slots(desired_members(spec, pods, answering, []).members))
    statuses = {
        "trainer-0": agent("trainer-0", Role.SOURCE, generations={19: (A, 0)}),
        "e-1": agent("e-1", generations={19: (B, 1)}),
        "e-2": agent("e-2", generations={19: (B, 2)}),
    }
    memory = Memory(planned_at={19: time.monotonic() - TIMEOUT - 1})
    parsed = sync(spec__prewarm__timeoutSeconds=TIMEOUT)

    assert Planner.prewarm_timed_out(
        parsed, Planned(planned, 19), statuses, pods, memory, now=time.monotonic()
    )
    benched = dict(memory.cooldown)
    assert set(benched) == {"uid-e-1", "uid-e-2"}  # the source never sits out
    excluded = {p.name for p in pods if p.uid in benched}
    waiting = desired_members(spec, pods, answering, planned, excluded=excluded)
    assert not waiting.formable  # nothing to plan while they sit out
    assert not needs_new_generation(waiting, planned, 19, statuses, abandoned=True)

    # Later passes still see generation 19 timed out, and bench nobody again.
    memory.cooldown = {uid: time.monotonic() - 1 for uid in benched}  # the sit-out is over
    assert Planner.prewarm_timed_out(
        parsed, Planned(planned, 19), statuses, pods, memory, now=time.monotonic()
    )
    assert all(deadline < time.monotonic() for deadline in memory.cooldown.values())
    back = desired_members(spec, pods, answering, planned)
    assert back.formable
    assert needs_new_generation(back, planned, 19, statuses, abandoned=True)


def test_a_timed_out_generation_whose_members_still_form_it_is_retried() -> None:
    """Cold but holding (stuck forming): the same members get a new generation once
    their sit-out ends, rather than waiting on the old one forever."""
    spec = sync().spec
    pods = [source_view(), sink_view("e-1")]
    desired = desired_members(spec, pods, {p.name for p in pods}, [])
    planned = list(slots(desired.members))
    forming = {
        "trainer-0": agent("trainer-0", Role.SOURCE, generations={7: (A, 0)}),
        "e-1": agent("e-1", generations={7: (GenerationState.FORMING, 1)}),
    }
    assert not needs_new_generation(desired, planned, 7, forming)
    assert needs_new_generation(desired, planned, 7, forming, abandoned=True)


def test_a_generation_that_pre_warmed_and_broke_later_benches_nobody() -> None:
    """Its trainer pod replaced: the sinks report the generation broken, which asks for a
    new one at once; treating it as a pre-warm timeout benched both sinks for a minute
    (the matrix's trainer replacement converged in 76-137 s)."""
    parsed = sync(spec__prewarm__timeoutSeconds=TIMEOUT)
    pods = [source_view(), sink_view("e-1"), sink_view("e-2", ip="10.0.1.2")]
    planned = list(slots(desired_members(parsed.spec, pods, {p.name for p in pods}, []).members))
    memory = Memory(planned_at={17: time.monotonic() - 5})
    warm = {
        "trainer-0": agent("trainer-0", Role.SOURCE, generations={17: (A, 0)}),
        "e-1": agent("e-1", generations={17: (A, 1)}),
        "e-2": agent("e-2", generations={17: (A, 2)}),
    }
    assert not Planner.prewarm_timed_out(
        parsed, Planned(planned, 17), warm, pods, memory, now=time.monotonic()
    )
    memory.planned_at[17] -= TIMEOUT  # long past its pre-warm timeout now
    broken = {
        "trainer-0": agent("trainer-0", Role.SOURCE),  # the replacement holds nothing
        "e-1": agent("e-1", generations={17: (B, 1)}),
        "e-2": agent("e-2", generations={17: (B, 2)}),
    }
    assert not Planner.prewarm_timed_out(
        parsed, Planned(planned, 17), broken, pods, memory, now=time.monotonic()
    )
    assert memory.cooldown == {}


def test_a_generation_the_status_does_not_record_yet_is_not_planned_again() -> None:
    """With the API server away a pass delivers its plan but cannot write the status;
    planning from the status, every later pass saw the agents on a generation the status
    did not name and planned another: the chaos run delivered generations 17 to 29, one
    a second, while the API server restarted, and none could form."""
    parsed = sync()
    raw = {"metadata": {"namespace": "ns", "name": "sync", "generation": 1}}
    pods = [source_view(), sink_view("e-1")]
    desired = desired_members(parsed.spec, pods, {p.name for p in pods}, [])
    delivered: list[int] = []

    class Agents:  # a test double: records the plans it would deliver to agents
        async def deliver(
            self, deliveries: dict[str, Any], token: str, versions: dict[str, int]
        ) -> dict[str, str]:
            delivered.append(next(iter(deliveries.values()))[1].generation)
            return {}

    settings = OperatorSettings(webhook_url="https://127.0.0.1:8443")
    planner = Planner(Agents(), settings, lambda *_: None)  # type: ignore[arg-type]
    memory = Memory()
    stale = WeightSyncStatus()  # what every read returns while the API server is away

    def plan(statuses: dict[str, AgentStatus]) -> tuple[list[Slot], int | None]:
        generation, previous = memory.planned(stale.group_generation, [])
        planned = planner.plan(
            raw, Stored(stale, previous), desired, statuses, evidence=statuses,
            memory=memory, generation=generation, plans_in_flight=False, now=time.monotonic(),
        )  # fmt: skip
        number = planned.generation
        if planned.fresh and number is not None:  # as the pass does, beside its status write
            refused = asyncio.run(
                planner.deliver(
                    raw, parsed, generation=number, desired=desired, token="t", memory=memory
                )
            )
            assert refused == {}
        return planned.members, number

    first, number = plan({})
    assert (number, delivered) == (1, [1])
    forming = {
        "trainer-0": agent("trainer-0", Role.SOURCE, generations={1: (F, 0)}),
        "e-1": agent("e-1", generations={1: (F, 1)}),
    }
    for _ in range(3):  # later passes, the status still naming no generation
        assert plan(forming) == (first, 1)
    assert delivered == [1]
    # A status read back with generation 1 in it: the memory lets go of its copy.
    assert memory.planned(1, first) == (1, first)
    assert memory.unsaved is None
