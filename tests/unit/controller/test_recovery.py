"""Recovery decisions: who is held out and recovers, from which holders, and the backoff."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from tests.unit.controller.builders import agent, sink_view, source_view, sync
from weightsync.api import reasons
from weightsync.api.control import (
    AgentStatus,
    GenerationState,
    RecoverRequest,
    RecoveryState,
    RecoveryStatus,
    RecoveryTransport,
)
from weightsync.api.v1alpha1 import RecoveryProtocol, Role
from weightsync.controller import metrics
from weightsync.controller.agents.client import AgentAddress, AgentClient
from weightsync.controller.passes.apply import carry_out
from weightsync.controller.readiness.gates import Current
from weightsync.controller.recovery.decisions import (
    RecoveryPass,
    Step,
    Tracker,
    backoff_seconds,
    behind,
    decide_recoveries,
    holders_of,
    plan_recoveries,
)
from weightsync.controller.status.observed import EventSpec

PORT = 8470
SPEC = sync(spec__recovery={"protocol": "TCP", "holders": 2}).spec
SOURCE = source_view()
OLD = sink_view("engine-old", ip="10.0.1.1")
NEW = sink_view("engine-new", ip="10.0.1.2")
PODS = [SOURCE, OLD, NEW]


def with_(status: AgentStatus, **changes: Any) -> AgentStatus:
    return status.model_copy(update=changes)


def recovery(
    state: RecoveryState, version: int = 5, started: int = 1000, **changes: Any
) -> RecoveryStatus:
    return RecoveryStatus(state=state, version=version, started_at_unix_millis=started, **changes)


def statuses(new: AgentStatus, *, source_holds: int | None = 5) -> dict[str, AgentStatus]:
    return {
        SOURCE.name: with_(agent(SOURCE.name, Role.SOURCE, version=5), holding=source_holds),
        OLD.name: agent(
            OLD.name, generations={3: (GenerationState.ACTIVE, 1)}, version=5, engine_version=5
        ),
        NEW.name: new,
    }


def decide_new(
    new: AgentStatus, tracker: Tracker | None = None, now: float = 100.0, **kwargs: Any
) -> Any:
    decisions = plan_recoveries(
        kwargs.get("spec", SPEC),
        Current(kwargs.get("version", 5)),
        pods=PODS,
        statuses=statuses(new, source_holds=kwargs.get("source_holds", 5)),
        trackers={NEW.uid: tracker} if tracker else {},
        now=now,
        default_port=PORT,
    )
    return {d.pod.name: d for d in decisions}


def test_a_fresh_sink_behind_recovers_from_the_holders_and_members_are_admitted() -> None:
    decisions = decide_new(agent(NEW.name))
    assert decisions[NEW.name].step is Step.START
    assert decisions[NEW.name].holders == ("http://10.0.0.1:8470",)
    assert OLD.name not in decisions  # current, in a generation: nothing to decide


def test_sink_holders_come_before_the_source() -> None:
    found = statuses(agent(NEW.name))
    found[OLD.name] = with_(found[OLD.name], holding=5)
    urls = holders_of(Current(5), PODS, found, PORT, excluding=NEW.name)
    assert urls == ["http://10.0.1.1:8470", "http://10.0.0.1:8470"]
    assert holders_of(Current(6), PODS, found, PORT, excluding=NEW.name) == []
    # a newer version of the lineage serves too (the recovery takes the newest)
    assert holders_of(Current(4), PODS, found, PORT, excluding=NEW.name) == urls


@pytest.mark.parametrize(
    ("status", "is_behind"),
    [
        (agent("p"), True),  # placeholder weights, no generation
        (agent("p", engine_version=4), True),
        (agent("p", engine_version=5), False),
        # in a warm group and merely a version behind: the next round brings it
        (agent("p", engine_version=4, generations={3: (GenerationState.WARM, 1)}), False),
        # in a warm group, its engine restarted in place (nothing vouched): it recovers
        (agent("p", engine_version=None, generations={3: (GenerationState.WARM, 1)}), True),
        # ...unless a round is already bringing it the version
        (
            agent(
                "p",
                engine_version=None,
                generations={3: (GenerationState.ACTIVE, 1)},
                round_in_progress=True,
            ),
            False,
        ),
        # an engine that is down is not asked: nothing could load what it pulls
        (agent("p", engine_healthy=False), False),
        (agent("p", engine_version=4, generations={3: (GenerationState.BROKEN, 1)}), True),
        # recovered 4 while the trainer published 5: admitted, the next round updates it
        (with_(agent("p", engine_version=4), recovery=recovery(RecoveryState.DONE, 4)), False),
        # recovered, then the engine restarted: behind again
        (with_(agent("p"), recovery=recovery(RecoveryState.DONE, 4)), True),
        (agent("p", Role.SOURCE, version=3), False),
    ],
)
def test_behind(status: AgentStatus, is_behind: bool) -> None:
    assert behind(status, Current(5)) is is_behind


def test_a_running_recovery_holds_the_pod_out() -> None:
    running = with_(agent(NEW.name), recovery=recovery(RecoveryState.RUNNING))
    assert decide_new(running)[NEW.name].step is Step.WAIT


def test_a_done_recovery_is_reported_once_and_admits_the_pod() -> None:
    done = with_(agent(NEW.name, engine_version=5), recovery=recovery(RecoveryState.DONE))
    decision = decide_new(done)[NEW.name]
    assert decision.step is Step.ADMIT
    assert decision.finished == done.recovery
    assert NEW.name not in decide_new(done, decision.tracker)  # reported: nothing to decide


def test_a_failed_recovery_backs_off_then_retries_other_holders() -> None:
    found = statuses(agent(NEW.name))
    found[OLD.name] = with_(found[OLD.name], holding=5)
    failed = with_(
        agent(NEW.name),
        recovery=recovery(
            RecoveryState.FAILED, reason="no_holder", holders_failed={"http://10.0.1.1:8470": "x"}
        ),
    )
    found[NEW.name] = failed
    trackers = {NEW.uid: Tracker()}

    def decide_at(now: float) -> Any:
        decisions = plan_recoveries(
            SPEC, Current(5), pods=PODS, statuses=found, trackers=trackers, now=now,
            default_port=PORT,
        )  # fmt: skip
        return next(d for d in decisions if d.pod.name == NEW.name)

    first = decide_at(100.0)
    assert (first.step, first.finished) == (Step.WAIT, failed.recovery)
    trackers[NEW.uid] = first.tracker
    assert first.tracker.failures == 1
    assert decide_at(100.0 + backoff_seconds(1) - 0.1).step is Step.WAIT
    retry = decide_at(100.0 + backoff_seconds(1))
    assert retry.step is Step.START
    assert retry.holders == ("http://10.0.0.1:8470",)  # the failed sink holder is left out
    assert retry.finished is None


def test_every_holder_failed_once_means_all_get_another_chance() -> None:
    tracker = Tracker(failures=1, failed_holders={"http://10.0.0.1:8470"})
    decision = decide_new(agent(NEW.name), tracker)[NEW.name]
    assert decision.holders == ("http://10.0.0.1:8470",)
    assert decision.tracker.failed_holders == set()
    assert tracker.failed_holders == {"http://10.0.0.1:8470"}  # decide does not mutate it


def test_backoff_doubles_up_to_a_ceiling() -> None:
    assert [backoff_seconds(n) for n in range(5)] == [0.0, 2.0, 4.0, 8.0, 16.0]
    assert backoff_seconds(30) == 60.0


def test_without_a_holder_the_pod_is_admitted_and_waits_for_a_round() -> None:
    assert decide_new(agent(NEW.name), source_holds=None)[NEW.name].step is Step.ADMIT
    assert decide_new(agent(NEW.name), source_holds=4)[NEW.name].step is Step.ADMIT


@pytest.mark.parametrize(
    "kwargs",
    [
        {"spec": sync(spec__recovery={"enabled": False}).spec},
        {"spec": sync(spec__mode="Colocated").spec},
        {"version": None},
    ],
)
def test_no_recovery_when_disabled_colocated_or_before_any_version(kwargs: Any) -> None:
    assert decide_new(agent(NEW.name), **kwargs) == {}


class RecordingAgents(AgentClient):
    """Answers `POST /v1/recover` from a table instead of the network."""

    def __init__(self, answers: Mapping[str, RecoveryStatus | str]) -> None:
        super().__init__(timeout_seconds=1)
        self.answers = answers
        self.requests: list[tuple[AgentAddress, RecoverRequest]] = []

    async def recover(
        self, agent: AgentAddress, request: RecoverRequest, token: str, *, peer_version: int
    ) -> RecoveryStatus | str:
        self.requests.append((agent, request))
        return self.answers[agent.pod]


def run(
    agents: RecordingAgents, found: Mapping[str, AgentStatus], trackers: dict[str, Tracker]
) -> tuple[RecoveryPass, list[EventSpec]]:
    """One pass's recoveries, decided then carried out; `trackers` takes the decided ones,
    as a pass's memory does."""
    events: list[EventSpec] = []
    decided = decide_recoveries(
        spec=SPEC, current=Current(5), pods=PODS, statuses=found, trackers=trackers,
        now=100.0, default_port=PORT,
    )  # fmt: skip
    trackers.clear()
    trackers.update(decided.trackers)
    asyncio.run(
        carry_out(
            decided, raw={"metadata": {"name": "sync", "namespace": "ns"}}, agents=agents,
            token="t", post_event=lambda _raw, event: events.append(event), now=100.0,
            default_port=PORT,
        )
    )  # fmt: skip
    return decided.held, events


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_run_starts_a_recovery_holds_the_pod_out_and_posts_an_event() -> None:
    agents = RecordingAgents({NEW.name: recovery(RecoveryState.PENDING)})
    before = sample("weightsync_operator_recoveries_total", {"result": "started"})
    result, events = run(agents, statuses(agent(NEW.name)), {})
    assert result.held_out == {NEW.name}
    assert result.in_flight
    [(address, request)] = agents.requests
    assert (address.pod, address.port) == (NEW.name, PORT)
    assert (request.version, request.holders, request.protocol.value) == (
        5, ["http://10.0.0.1:8470"], "TCP",
    )  # fmt: skip
    assert [e.reason for e in events] == [reasons.RECOVERY_STARTED]
    assert sample("weightsync_operator_recoveries_total", {"result": "started"}) == before + 1


def test_run_asks_for_what_the_holders_serve() -> None:
    rdma = RecoveryTransport(protocol=RecoveryProtocol.RDMA, usable=True, detail="Auto: RDMA")
    found = {
        pod: with_(status, recovery_transport=rdma)
        for pod, status in statuses(agent(NEW.name)).items()
    }
    agents = RecordingAgents({NEW.name: recovery(RecoveryState.PENDING)})
    _, events = run(agents, found, {})
    [(_, request)] = agents.requests
    assert request.protocol is RecoveryProtocol.RDMA
    assert "over RDMA" in events[0].message


def test_run_reports_done_with_duration_and_bandwidth_and_admits() -> None:
    done = recovery(
        RecoveryState.DONE, bytes=4096, duration_millis=250, bandwidth_bytes_per_second=16384,
        holders_used=["http://10.0.0.1:8470"],
    )  # fmt: skip
    found = statuses(with_(agent(NEW.name, engine_version=5), recovery=done))
    before = sample("weightsync_operator_recovery_duration_seconds_count")
    result, events = run(RecordingAgents({}), found, {})
    assert result.held_out == frozenset()
    assert not result.in_flight
    [event] = events
    assert (event.type, event.reason) == ("Normal", reasons.RECOVERED)
    assert "250 ms" in event.message
    assert "16384 bytes/s" in event.message
    assert sample("weightsync_operator_recovery_duration_seconds_count") == before + 1


def test_run_reports_a_failure_as_a_warning_and_a_refusal_backs_off() -> None:
    failed = recovery(RecoveryState.FAILED, reason="timeout", message="pull took too long")
    trackers: dict[str, Tracker] = {}
    result, events = run(
        RecordingAgents({}), statuses(with_(agent(NEW.name), recovery=failed)), trackers
    )
    assert result.held_out == {NEW.name}
    [event] = events
    assert (event.type, event.reason) == ("Warning", reasons.RECOVERY_FAILED)
    assert "timeout: pull took too long" in event.message
    assert trackers[NEW.uid].failures == 1

    refusing = RecordingAgents({NEW.name: "HTTP 409 busy: a round is in progress"})
    trackers = {}
    result, events = run(refusing, statuses(agent(NEW.name)), trackers)
    assert [e.type for e in events] == ["Warning"]
    assert "busy" in events[0].message
    assert trackers[NEW.uid].retry_at > 100.0
