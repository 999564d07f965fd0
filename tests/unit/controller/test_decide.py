"""The decide step of a pass, on observations built here: no API server, no agents, no
event loop. Each test also checks that `decide` left the soft state it was given alone."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from tests.unit.controller.builders import agent, sink_view, source_view, sync
from weightsync.api import ConditionType, find_condition, reasons
from weightsync.api.control import AgentStatus, GenerationState
from weightsync.api.protocol import PROTOCOL_VERSION
from weightsync.api.v1alpha1 import Member, Role, WeightSync, WeightSyncStatus
from weightsync.controller.agents.view import AgentView
from weightsync.controller.membership.workloads import PodView
from weightsync.controller.passes.actions import Actions, Outcome
from weightsync.controller.passes.decide import decide
from weightsync.controller.passes.memory import SoftState
from weightsync.controller.passes.observe import Blocked, Observed

NOW = 5000.0  # monotonic, the observation's
AT = datetime(2026, 1, 1, tzinfo=UTC)
A, F = GenerationState.ACTIVE, GenerationState.FORMING
SOURCE = source_view()
E1 = sink_view("e-1", ip="10.0.1.1")
E2 = sink_view("e-2", ip="10.0.1.2", index=1)
RAW = {"metadata": {"namespace": "ns", "name": "sync", "uid": "u", "generation": 1}}


def observed(
    statuses: Mapping[str, AgentStatus],
    *,
    pods: list[PodView] | None = None,
    parsed: WeightSync | None = None,
    old: WeightSyncStatus | None = None,
    **changes: Any,
) -> Observed:
    """What a pass over `pods` (the source, e-1 and e-2) read, each agent in `statuses`
    answering a second before the reads ended."""
    pods = [SOURCE, E1, E2] if pods is None else pods
    view = AgentView(statuses=dict(statuses), heard_at=dict.fromkeys(statuses, NOW - 1))
    return Observed(
        RAW, old or WeightSyncStatus(), 1, AT,
        sync=parsed or sync(), pods=pods,
        replicas=sum(1 for p in pods if p.role is Role.SINK), sources=[0], agents=view,
        now=NOW, token="t", agent_port=8470, **changes,
    )  # fmt: skip


def decided(seen: Observed, soft: SoftState) -> Actions:
    """`decide`, checking it changed nothing it was given."""
    before, seen_before = copy.deepcopy(soft), copy.deepcopy(seen)
    actions = decide(seen, soft)
    assert soft == before
    assert seen == seen_before
    return actions


def grouped(generation: int, *pods: PodView, version: int | None = None) -> WeightSyncStatus:
    """A stored status naming `generation` with `pods` ranked in order."""
    members = [
        Member(pod=p.name, role=p.role, rank=rank, node="node-a", warm=True)
        for rank, p in enumerate(pods)
    ]
    return WeightSyncStatus(group_generation=generation, members=members, current_version=version)


def test_a_blocked_pass_writes_ready_false_and_nothing_else() -> None:
    problem = Blocked(Outcome.WAITING, reasons.TRAINER_NOT_FOUND, "trainer not found")
    seen = Observed(RAW, WeightSyncStatus(), 1, AT, blocked=problem)
    actions = decided(seen, SoftState())
    assert actions.result.outcome is Outcome.WAITING
    assert actions.status is not None
    ready = find_condition(actions.status.new.conditions, ConditionType.READY)
    assert ready is not None
    assert (ready.status, ready.reason) == ("False", reasons.TRAINER_NOT_FOUND)
    assert [e.reason for e in actions.status.events] == [reasons.TRAINER_NOT_FOUND]
    assert actions.soft is None  # the soft state is as it was
    assert (actions.plans, actions.recoveries, actions.gates) == (None, None, ())
    assert not actions.write_token  # written already (the default) or no token


def test_a_pass_waiting_for_its_workloads_writes_their_pods_token_first() -> None:
    # The trainer's pods may come with its StatefulSet: they cannot start without it.
    problem = Blocked(Outcome.WAITING, reasons.TRAINER_NOT_FOUND, "trainer not found")
    seen = Observed(
        RAW, WeightSyncStatus(), 1, AT, blocked=problem, token="t0k", token_written=False
    )
    assert decided(seen, SoftState()).write_token


def test_a_first_pass_plans_a_generation_and_names_it_in_the_status() -> None:
    statuses = {
        SOURCE.name: agent(SOURCE.name, Role.SOURCE),
        E1.name: agent(E1.name),
        E2.name: agent(E2.name),
    }
    actions = decided(observed(statuses, token_written=False), SoftState())
    assert actions.result.outcome is Outcome.OK
    assert actions.write_token
    assert actions.plans is not None
    assert actions.plans.generation == 1
    assert [m.name for m in actions.plans.desired.members] == ["trainer-0", "e-1", "e-2"]
    assert actions.status is not None
    assert actions.status.new.group_generation == 1
    assert [m.pod for m in actions.status.new.members] == ["trainer-0", "e-1", "e-2"]
    assert actions.status.made_from is not None  # the plans' refusals are written from it
    # The soft state after: the generation counts as delivered now (its clocks start),
    # and is remembered until a status read back names it.
    soft = actions.soft
    assert soft is not None
    assert soft.planned_at == {1: NOW}
    assert set(soft.deliveries[1].members) == {"trainer-0", "e-1", "e-2"}
    assert soft.unsaved is not None
    assert soft.unsaved.generation == 1


def test_no_generation_is_planned_while_the_last_ones_plans_go_out() -> None:
    # e-2 answered holding no generation: evidence of a broken group, were the plans in.
    statuses = {
        SOURCE.name: agent(SOURCE.name, Role.SOURCE, generations={1: (F, 0)}),
        E1.name: agent(E1.name, generations={1: (F, 1)}),
        E2.name: agent(E2.name),
    }
    old = grouped(1, SOURCE, E1, E2)
    soft = SoftState(planned_at={1: NOW - 2})
    sending = decided(observed(statuses, old=old, plans_in_flight=True), soft)
    assert sending.plans is None
    assert sending.status is not None
    assert sending.status.new.group_generation == 1
    # The same pass once they are all sent: a new generation.
    sent = decided(observed(statuses, old=old), soft)
    assert sent.plans is not None
    assert sent.plans.generation == 2


def test_a_pod_behind_recovers_held_out_of_the_group_and_brings_a_pass_soon() -> None:
    parsed = sync(spec__recovery={"protocol": "TCP", "holders": 1})
    statuses = {
        SOURCE.name: agent(SOURCE.name, Role.SOURCE, generations={1: (A, 0)}, version=5).model_copy(
            update={"holding": 5}
        ),
        E1.name: agent(E1.name, generations={1: (A, 1)}, version=5, engine_version=5),
        E2.name: agent(E2.name),  # replaced: in no generation, serving nothing
    }
    old = grouped(1, SOURCE, E1, version=5)
    actions = decided(observed(statuses, parsed=parsed, old=old), SoftState())
    assert actions.recoveries is not None
    [start] = actions.recoveries.starts
    assert start.pod.name == "e-2"
    assert (start.request.version, start.request.holders) == (5, ["http://10.0.0.1:8470"])
    assert actions.recoveries.held.held_out == {"e-2"}
    assert actions.plans is None  # e-2 is not planned in while it recovers
    assert (actions.poll_soon, actions.watched) == (True, frozenset({"e-2"}))
    assert actions.soft is not None
    assert set(actions.soft.recoveries) == {E2.uid}
    gates = {g.pod: (g.status, g.reason) for g in actions.gates}
    assert gates == {
        "e-1": (True, reasons.SERVES_CURRENT_VERSION),
        "e-2": (False, reasons.BEHIND_CURRENT_VERSION),
    }


def test_a_generation_planned_this_pass_keeps_its_members_gates_closed_until_they_hold_it() -> None:
    """The pass counts its own new generation as delivered: the source will run its next
    round there, so a sink that answered before the plan is still in the rounds, and one
    the plan leaves out is not."""
    statuses = {
        SOURCE.name: agent(SOURCE.name, Role.SOURCE, version=4),
        E1.name: agent(E1.name, version=4, engine_version=4),
        E2.name: agent(E2.name, version=4, engine_version=4),
    }
    old = WeightSyncStatus(current_version=4)
    cooling = SoftState(cooldown={E2.uid: NOW + 5})  # e-2 refused a plan a moment ago
    actions = decided(observed(statuses, old=old), cooling)
    assert actions.plans is not None
    assert [m.name for m in actions.plans.desired.members] == ["trainer-0", "e-1"]
    gates = {g.pod: (g.status, g.reason) for g in actions.gates}
    assert gates == {
        "e-1": (True, reasons.SERVES_CURRENT_VERSION),
        "e-2": (False, reasons.NOT_IN_ROUNDS),
    }


def test_a_generation_past_its_pre_warm_timeout_benches_its_cold_members_once() -> None:
    parsed = sync(spec__prewarm__timeoutSeconds=60)
    statuses = {
        SOURCE.name: agent(SOURCE.name, Role.SOURCE, generations={7: (A, 0)}),
        E1.name: agent(E1.name, generations={7: (F, 1)}),  # cold: still forming
    }
    old = grouped(7, SOURCE, E1)
    pods = [SOURCE, E1]
    soft = SoftState(planned_at={7: NOW - 61})
    actions = decided(observed(statuses, pods=pods, parsed=parsed, old=old), soft)
    after = actions.soft
    assert after is not None
    assert (after.abandoned, after.cooldown) == (7, {E1.uid: NOW + 60})
    assert actions.status is not None
    prewarmed = find_condition(actions.status.new.conditions, ConditionType.PREWARMED)
    assert prewarmed is not None
    assert (prewarmed.status, prewarmed.reason) == ("False", reasons.PREWARM_TIMED_OUT)
    # The next pass, the soft state adopted: no second bench.
    again = decided(observed(statuses, pods=pods, parsed=parsed, old=old), after)
    assert again.soft is not None
    assert again.soft.cooldown == after.cooldown


def test_an_agent_beyond_the_protocol_skew_is_reported_and_neither_planned_nor_recovered() -> None:
    parsed = sync(spec__recovery={"protocol": "TCP", "holders": 1})
    far = PROTOCOL_VERSION + 2  # two releases ahead: its messages may mean other things
    statuses = {
        SOURCE.name: agent(SOURCE.name, Role.SOURCE, generations={1: (A, 0)}, version=5).model_copy(
            update={"holding": 5}
        ),
        E1.name: agent(E1.name, generations={1: (A, 1)}, version=5, engine_version=5),
        E2.name: agent(E2.name).model_copy(update={"protocol_version": far}),  # behind, too
    }
    old = grouped(1, SOURCE, E1, version=5)
    actions = decided(observed(statuses, parsed=parsed, old=old), SoftState())
    assert actions.plans is None  # the group it would have joined stays as it is
    assert actions.recoveries is not None
    assert actions.recoveries.starts == ()
    assert actions.status is not None
    degraded = find_condition(actions.status.new.conditions, ConditionType.DEGRADED)
    assert degraded is not None
    assert (degraded.status, degraded.reason) == ("True", reasons.AGENT_PROTOCOL_SKEW)
    assert f"e-2 speak control protocol version {far}" in degraded.message
    assert reasons.AGENT_PROTOCOL_SKEW in [e.reason for e in actions.status.events]
    # Within one version either side, the same agent is planned in.
    near = {**statuses, E2.name: statuses[E2.name].model_copy(update={"protocol_version": 1})}
    fine = decided(observed(near, parsed=parsed, old=old), SoftState())
    assert fine.recoveries is not None
    assert [s.pod.name for s in fine.recoveries.starts] == ["e-2"]
    # One that serves the current version would join the group, within the skew only.
    current = agent(E2.name, version=5, engine_version=5)
    for version, joins in ((far, False), (PROTOCOL_VERSION + 1, True)):
        said = {**statuses, E2.name: current.model_copy(update={"protocol_version": version})}
        joined = decided(observed(said, parsed=parsed, old=old), SoftState())
        planned = joined.plans.desired.members if joined.plans is not None else ()
        assert ("e-2" in [m.name for m in planned]) is joins
