"""Status and Events from one pass's observations."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.unit.controller.builders import agent, round_report, sink_view, source_view, sync
from weightsync.api import find_condition, reasons
from weightsync.api.control import AgentStatus, GenerationState
from weightsync.api.v1alpha1 import Role, RoundFailure, RoundSummary, WeightSyncStatus
from weightsync.controller.membership.plan import Slot, desired_members, slots
from weightsync.controller.readiness.gates import Current
from weightsync.controller.status.observed import (
    Observation,
    observed_status,
    problem_status,
)
from weightsync.controller.status.transitions import transition_events

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
W, A = GenerationState.WARM, GenerationState.ACTIVE


def observe(
    statuses: dict[str, AgentStatus],
    *,
    current: int | None,
    pods: list | None = None,  # type: ignore[type-arg]
    **changes: object,
) -> Observation:
    pods = pods or [source_view(), sink_view("e-1"), sink_view("e-2")]
    spec = changes.pop("spec", None) or sync().spec
    desired = desired_members(spec, pods, statuses.keys(), [])  # type: ignore[arg-type]
    fields: dict[str, object] = {
        "spec": spec,
        "metadata_generation": 3,
        "pods": pods,
        "statuses": statuses,
        "desired": desired,
        "planned": list(slots(desired.members)),
        "planned_generation": 2,
        "current": Current(current),
    }
    fields.update(changes)
    return Observation(**fields)  # type: ignore[arg-type]


def warm_group(version: int | None = None, served: int | None = None) -> dict[str, AgentStatus]:
    return {
        "trainer-0": agent("trainer-0", Role.SOURCE, generations={2: (A, 0)}, version=version,
                           last_round=round_report(version) if version else None),
        "e-1": agent("e-1", generations={2: (A, 1)}, engine_version=served),
        "e-2": agent("e-2", generations={2: (W, 2)}, engine_version=served),
    }  # fmt: skip


def conditions(status: WeightSyncStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status.value, c.reason) for c in status.conditions}


def test_a_warm_group_before_the_first_version() -> None:
    status = observed_status(WeightSyncStatus(), observe(warm_group(), current=None), NOW)
    assert conditions(status) == {
        "Ready": ("True", reasons.AWAITING_FIRST_VERSION),
        "Prewarmed": ("True", reasons.GROUP_WARM),
        "Syncing": ("False", reasons.IDLE),
        "Degraded": ("False", reasons.AS_EXPECTED),
        # These agents predate reporting their protocol: under Auto they use TCP.
        "RecoveryProtocol": ("True", reasons.USING_TCP),
    }
    assert [c.type for c in status.conditions] == [
        "Ready",
        "Prewarmed",
        "Syncing",
        "Degraded",
        "RecoveryProtocol",
    ]
    assert status.group_generation == 2
    assert status.member_count == 3
    assert [(m.pod, m.rank, m.role.value, m.warm) for m in status.members] == [
        ("trainer-0", 0, "Source", True),
        ("e-1", 1, "Sink", True),
        ("e-2", 2, "Sink", True),
    ]
    assert status.observed_generation == 3
    assert all(c.observed_generation == 3 for c in status.conditions)


def test_after_a_round_every_sink_current() -> None:
    status = observed_status(WeightSyncStatus(), observe(warm_group(4, 4), current=4), NOW)
    assert conditions(status)["Ready"] == ("True", reasons.ALL_MEMBERS_CURRENT)
    assert status.current_version == 4
    assert [m.version for m in status.members] == [4, 4, 4]
    assert status.last_round is not None
    assert status.last_round.version == 4
    assert status.last_round.duration_millis == 120
    assert status.last_round.completion_time == datetime(2026, 1, 1, 0, 0, tzinfo=UTC)


def test_members_as_stored_are_kept_and_any_change_is_written() -> None:
    before = observed_status(WeightSyncStatus(), observe(warm_group(4, 4), current=4), NOW)
    again = observed_status(before, observe(warm_group(4, 4), current=4), NOW)
    assert all(a is b for a, b in zip(again.members, before.members, strict=True))
    moved = warm_group(4, 4)
    moved["e-2"] = agent("e-2", generations={2: (W, 2)}, engine_version=5)
    after = observed_status(before, observe(moved, current=4), NOW)
    assert [m.version for m in after.members] == [4, 4, 5]
    assert after.members[:2] == before.members[:2]
    swapped = [
        Slot(0, "trainer-0", Role.SOURCE),
        Slot(1, "e-2", Role.SINK),
        Slot(2, "e-1", Role.SINK),
    ]
    statuses = warm_group(4, 4)
    statuses["e-1"] = agent("e-1", generations={2: (A, 2)}, engine_version=4)
    statuses["e-2"] = agent("e-2", generations={2: (A, 1)}, engine_version=4)
    reordered = observed_status(before, observe(statuses, current=4, planned=swapped), NOW)
    assert [(m.pod, m.rank) for m in reordered.members] == [
        ("trainer-0", 0), ("e-2", 1), ("e-1", 2)
    ]  # fmt: skip


def test_a_sink_behind_and_a_cold_member() -> None:
    statuses = warm_group(4, 4)
    statuses["e-2"] = agent("e-2", generations={2: (GenerationState.FORMING, 2)}, engine_version=3)
    status = observed_status(WeightSyncStatus(), observe(statuses, current=4), NOW)
    assert conditions(status)["Ready"] == ("False", reasons.MEMBERS_BEHIND)
    assert conditions(status)["Prewarmed"] == ("False", reasons.WARMING)
    timed_out = observed_status(
        WeightSyncStatus(), observe(statuses, current=4, prewarm_timed_out=True), NOW
    )
    prewarmed = find_condition(timed_out.conditions, "Prewarmed")
    assert prewarmed is not None
    assert prewarmed.reason == reasons.PREWARM_TIMED_OUT
    assert "cold ranks: 2" in prewarmed.message


def test_waiting_for_members_counts_every_live_inference_pod() -> None:
    pods = [source_view(), sink_view("e-1"), sink_view("e-2", containers_ready=False)]
    statuses = warm_group()
    del statuses["e-2"]
    status = observed_status(WeightSyncStatus(), observe(statuses, current=None, pods=pods), NOW)
    ready = find_condition(status.conditions, "Ready")
    assert ready is not None
    assert (ready.status.value, ready.reason) == ("False", reasons.WAITING_FOR_MEMBERS)
    assert ready.message.startswith("2 of 3 ranks")


def test_every_source_rank_counts_as_an_expected_member() -> None:
    spec = sync(spec__trainer__sourceRanks=[0, 1]).spec
    pods = [source_view(), sink_view("e-1")]
    status = observed_status(
        WeightSyncStatus(), observe(warm_group(), current=None, pods=pods, spec=spec), NOW
    )
    ready = find_condition(status.conditions, "Ready")
    assert ready is not None
    assert ready.message.startswith("0 of 3 ranks"), ready.message  # 2 sources + 1 sink
    assert "trainer rank 1" in ready.message


def test_degraded_for_missing_sidecars_failed_rounds_and_refused_plans() -> None:
    pods = [source_view(), sink_view("e-1"), sink_view("e-2"), sink_view("bare", has_agent=False)]
    status = observed_status(
        WeightSyncStatus(), observe(warm_group(), current=None, pods=pods), NOW
    )
    degraded = find_condition(status.conditions, "Degraded")
    assert degraded is not None
    assert degraded.reason == reasons.SIDECAR_MISSING
    assert "bare" in degraded.message

    statuses = warm_group(4, 4)
    statuses["trainer-0"] = agent(
        "trainer-0", Role.SOURCE, generations={2: (A, 0)}, version=4,
        last_round=round_report(5, ok=False, reason="peer_failed"),
    )  # fmt: skip
    status = observed_status(WeightSyncStatus(), observe(statuses, current=4), NOW)
    assert conditions(status)["Degraded"] == ("True", reasons.ROUND_FAILED)
    assert status.last_round is None  # a failed round is not a completed one

    refused = observe(warm_group(), current=None, plan_errors={"e-1": "HTTP 409 plan_rejected"})
    status = observed_status(WeightSyncStatus(), refused, NOW)
    degraded = find_condition(status.conditions, "Degraded")
    assert degraded is not None
    assert degraded.reason == reasons.MEMBER_FAILED
    assert "HTTP 409" in degraded.message


def test_syncing_while_the_source_reports_a_round() -> None:
    statuses = warm_group(4, 4)
    statuses["trainer-0"] = statuses["trainer-0"].model_copy(update={"round_in_progress": True})
    status = observed_status(WeightSyncStatus(), observe(statuses, current=4), NOW)
    assert conditions(status)["Syncing"] == ("True", reasons.ROUND_IN_PROGRESS)


def test_transition_times_move_only_on_flips_and_events_follow_changes() -> None:
    first = observed_status(WeightSyncStatus(), observe(warm_group(), current=None), NOW)
    events = transition_events(WeightSyncStatus(), first)
    assert {(e.type, e.reason) for e in events} == {
        ("Normal", reasons.AWAITING_FIRST_VERSION),
        ("Normal", reasons.GROUP_WARM),
        ("Normal", reasons.AS_EXPECTED),
        ("Normal", reasons.USING_TCP),
    }  # Syncing's Idle is no transition worth an Event
    later = NOW + timedelta(minutes=1)
    second = observed_status(first, observe(warm_group(4, 4), current=4), later)
    ready_before = find_condition(first.conditions, "Ready")
    ready_after = find_condition(second.conditions, "Ready")
    assert ready_before is not None
    assert ready_after is not None
    assert ready_after.last_transition_time == ready_before.last_transition_time  # still True
    events = transition_events(first, second)
    assert [(e.type, e.reason) for e in events] == [
        ("Normal", reasons.ALL_MEMBERS_CURRENT),
        ("Normal", reasons.VERSION_SYNCED),
    ]
    assert (
        transition_events(
            second, observed_status(second, observe(warm_group(4, 4), current=4), later)
        )
        == []
    )


def test_a_problem_sets_ready_false_keeps_the_rest_and_warns() -> None:
    first = observed_status(WeightSyncStatus(), observe(warm_group(4, 4), current=4), NOW)
    message = reasons.DEPLOYMENT_NOT_FOUND_MESSAGE.format(kind="Deployment", name="engine-b")
    broken = problem_status(first, 4, reasons.DEPLOYMENT_NOT_FOUND, message, NOW)
    assert conditions(broken)["Ready"] == ("False", reasons.DEPLOYMENT_NOT_FOUND)
    assert conditions(broken)["Prewarmed"] == conditions(first)["Prewarmed"]
    assert broken.members == first.members
    assert broken.observed_generation == 4
    (event,) = transition_events(first, broken)
    assert (event.type, event.reason) == ("Warning", reasons.DEPLOYMENT_NOT_FOUND)
    assert "engine-b" in event.message

    fresh = problem_status(WeightSyncStatus(), 1, reasons.TRAINER_NOT_FOUND, "gone", NOW)
    assert conditions(fresh) == {
        "Ready": ("False", reasons.TRAINER_NOT_FOUND),
        "Prewarmed": ("False", reasons.TRAINER_NOT_FOUND),
        "Syncing": ("False", reasons.TRAINER_NOT_FOUND),
        "Degraded": ("False", reasons.TRAINER_NOT_FOUND),
        "RecoveryProtocol": ("False", reasons.TRAINER_NOT_FOUND),
    }
    (event,) = transition_events(WeightSyncStatus(), fresh)
    assert event.type == "Warning"


def test_a_pending_workload_is_a_normal_event_and_missing_after_the_grace_a_warning() -> None:
    pending = problem_status(WeightSyncStatus(), 1, reasons.WORKLOAD_PENDING, "not yet", NOW)
    assert set(conditions(pending).values()) == {("False", reasons.WORKLOAD_PENDING)}
    (event,) = transition_events(WeightSyncStatus(), pending)
    assert (event.type, event.reason) == ("Normal", reasons.WORKLOAD_PENDING)
    # Still missing after the grace: the user's error, every condition saying so.
    missing = problem_status(pending, 1, reasons.TRAINER_NOT_FOUND, "gone", NOW)
    assert set(conditions(missing).values()) == {("False", reasons.TRAINER_NOT_FOUND)}
    (event,) = transition_events(pending, missing)
    assert (event.type, event.reason) == ("Warning", reasons.TRAINER_NOT_FOUND)


def test_a_failed_pod_left_behind_is_not_waited_for() -> None:
    # A killed engine pod stays in phase Failed beside its replacement; Ready counts the
    # pods that can take part.
    pods = [source_view(), sink_view("e-1"), sink_view("e-2"), sink_view("e-0", finished=True)]
    status = observed_status(
        WeightSyncStatus(), observe(warm_group(4, 4), current=4, pods=pods), NOW
    )
    assert conditions(status)["Ready"] == ("True", reasons.ALL_MEMBERS_CURRENT)


def test_agents_that_refuse_the_token_make_the_sync_degraded() -> None:
    errors = {"e-2": "HTTP 401 unauthorized: bad token", "e-1": "timeout"}
    observation = observe(warm_group(4, 4), current=4, agent_errors=errors)
    status = observed_status(WeightSyncStatus(), observation, NOW)
    degraded = find_condition(status.conditions, "Degraded")
    assert degraded is not None
    assert (degraded.status.value, degraded.reason) == ("True", reasons.AGENT_REFUSES_OPERATOR)
    assert "e-2" in degraded.message
    assert "e-1" not in degraded.message


def test_events_mark_transitions_not_every_round() -> None:
    def at(seconds: int) -> datetime:
        return NOW + timedelta(seconds=seconds)

    def synced(version: int, seconds: int) -> RoundSummary:
        return RoundSummary(
            version=version,
            completion_time=at(seconds),
            duration_millis=50,
            bytes=1,
            bandwidth_bytes_per_second=20,
        )

    def failed(version: int, seconds: int) -> RoundFailure:
        return RoundFailure(version=version, time=at(seconds), reason="engine_timeout")

    start = WeightSyncStatus()
    one = start.model_copy(update={"last_round": synced(1, 1)})
    two = one.model_copy(update={"last_round": synced(2, 2)})
    fails = two.model_copy(update={"last_failure": failed(3, 3)})
    fails_again = fails.model_copy(update={"last_failure": failed(4, 4)})
    back = fails_again.model_copy(update={"last_round": synced(5, 5)})
    steps = [(start, one), (one, two), (two, fails), (fails, fails_again), (fails_again, back)]
    assert [[e.reason for e in transition_events(old, new)] for old, new in steps] == [
        [reasons.VERSION_SYNCED],  # the first version
        [],  # a healthy run's next round
        [reasons.ROUND_FAILED],  # failing after a success
        [],  # still failing
        [reasons.VERSION_SYNCED],  # synced again
    ]
    busy = observed_status(WeightSyncStatus(), observe(warm_group(4, 4), current=4), NOW)
    statuses = warm_group(4, 4)
    statuses["trainer-0"] = statuses["trainer-0"].model_copy(update={"round_in_progress": True})
    flipped = observed_status(busy, observe(statuses, current=4), NOW)
    assert conditions(flipped)["Syncing"] == ("True", reasons.ROUND_IN_PROGRESS)
    assert transition_events(busy, flipped) == []
