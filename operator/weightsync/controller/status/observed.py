"""The WeightSync's status from one reconcile pass's observations, and its Events. Pure.

A pass builds the whole status (conditions, members, versions), the caller compares it
with the stored one and writes it once. Events are derived from the difference: a
condition whose (status, reason) changed, a newly planned generation, a new version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from weightsync.api import reasons
from weightsync.api.conditions import (
    Condition,
    ConditionStatus,
    ConditionType,
    ConditionUpdate,
    find_condition,
    set_conditions,
)
from weightsync.api.control import AgentStatus, GenerationState, GenerationStatus
from weightsync.api.protocol import PROTOCOL_VERSION, SKEW
from weightsync.api.v1alpha1 import (
    Member,
    Role,
    RoundFailure,
    RoundSummary,
    SyncMode,
    WeightSyncSpec,
    WeightSyncStatus,
)
from weightsync.controller.membership.plan import Desired, Slot, warm_at
from weightsync.controller.membership.workloads import PodView
from weightsync.controller.readiness.gates import Current, served_version
from weightsync.controller.recovery.pull_protocol import protocol_condition

T, F = ConditionStatus.TRUE, ConditionStatus.FALSE
CONDITION_ORDER = (
    ConditionType.READY,
    ConditionType.PREWARMED,
    ConditionType.SYNCING,
    ConditionType.DEGRADED,
    ConditionType.RECOVERY_PROTOCOL,
)
# Ready=False for these is the user's to fix: the transition is a Warning Event.
USER_ERRORS = frozenset(
    {
        reasons.INVALID_SPEC,
        reasons.TRAINER_NOT_FOUND,
        reasons.DEPLOYMENT_NOT_FOUND,
        reasons.WORKLOAD_CLAIMED,
        reasons.RANKS_BEYOND_TRAINER,
    }
)


@dataclass(frozen=True, slots=True)
class EventSpec:
    """An Event to post on the WeightSync."""

    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one pass learned, the input of `observed_status`."""

    spec: WeightSyncSpec
    metadata_generation: int
    pods: Sequence[PodView]
    statuses: Mapping[str, AgentStatus]
    desired: Desired
    planned: Sequence[Slot]
    planned_generation: int | None
    current: Current
    prewarm_timed_out: bool = False
    plan_errors: Mapping[str, str] = field(default_factory=dict)
    agent_errors: Mapping[str, str] = field(default_factory=dict)  # status polls that failed
    sources: Sequence[int] | None = None  # the trainer ranks planned (default: the listed)
    skewed: Mapping[str, int] = field(default_factory=dict)  # `protocol.out_of_skew`, by pod


def _ordered(conditions: Sequence[Condition]) -> list[Condition]:
    rank = {kind.value: index for index, kind in enumerate(CONDITION_ORDER)}
    return sorted(conditions, key=lambda c: rank.get(c.type, len(rank)))


def problem_status(
    old: WeightSyncStatus, metadata_generation: int, reason: str, message: str, now: datetime
) -> WeightSyncStatus:
    """Ready=False for something the user must fix. Conditions an earlier pass set are
    kept; the others say what they can on this pass: no group, no round, nothing running
    to degrade, for the same reason (never Unknown once the operator has looked)."""
    updates = [ConditionUpdate(ConditionType.READY, F, reason, message)]
    blocked = {
        ConditionType.PREWARMED: F,
        ConditionType.SYNCING: F,
        ConditionType.DEGRADED: F,
        ConditionType.RECOVERY_PROTOCOL: F,
    }
    for kind in CONDITION_ORDER[1:]:
        found = find_condition(old.conditions, kind)
        # A workload pending on an earlier pass is no longer (it came, or is missing now).
        pending = found is not None and found.reason == reasons.WORKLOAD_PENDING
        if found is None or found.status == ConditionStatus.UNKNOWN or pending:
            updates.append(ConditionUpdate(kind, blocked[kind], reason, message))
    conditions = set_conditions(
        old.conditions, updates, observed_generation=metadata_generation, now=now
    )
    return old.model_copy(
        update={"conditions": _ordered(conditions), "observed_generation": metadata_generation}
    )


def members(
    planned: Sequence[Slot],
    generation: int | None,
    pods: Mapping[str, PodView],
    statuses: Mapping[str, AgentStatus],
    stored: Sequence[Member] = (),
) -> list[Member]:
    """The members' entries; one equal to the `stored` entry at its rank is that entry:
    most are, every pass, and a thousand validated anew were a tenth of a status."""
    result = []
    for slot in planned:
        status = statuses.get(slot.pod)
        pod = pods.get(slot.pod)
        if slot.role is Role.SOURCE:
            version = status.version if status is not None else None
        else:
            version = served_version(status)
        node = pod.node if pod is not None else None
        warm = warm_at(status, generation, slot.rank)
        kept = stored[slot.rank] if slot.rank < len(stored) else None
        if not (
            kept is not None
            and kept.rank == slot.rank
            and kept.pod == slot.pod
            and kept.role is slot.role
            and kept.node == node
            and kept.version == version
            and kept.warm is warm
        ):
            kept = Member(
                pod=slot.pod, role=slot.role, rank=slot.rank, node=node, version=version, warm=warm
            )
        result.append(kept)
    return result


def last_failure(source: AgentStatus | None, stored: RoundFailure | None) -> RoundFailure | None:
    """The source's last round if it failed, else the last failure the status recorded."""
    report = source.last_round if source is not None else None
    if report is None or report.ok:
        return stored
    finished = datetime.fromtimestamp(report.finished_at_unix_millis / 1000, UTC)
    return RoundFailure(
        version=report.version,
        time=finished.replace(microsecond=0),
        member=report.member[:512],
        stage=report.stage[:32],
        reason=report.reason[:128],
        message=report.message[:1024],
    )


def last_round(source: AgentStatus | None, stored: RoundSummary | None) -> RoundSummary | None:
    """The source's last round if it succeeded, else the last one the status recorded."""
    report = source.last_round if source is not None else None
    if report is None or not report.ok:
        return stored
    finished = datetime.fromtimestamp(report.finished_at_unix_millis / 1000, UTC)
    return RoundSummary(
        version=report.version,
        completion_time=finished.replace(microsecond=0),
        duration_millis=report.duration_millis,
        bytes=report.bytes,
        bandwidth_bytes_per_second=report.bandwidth_bytes_per_second,
    )


def _ready(obs: Observation, sinks: Sequence[Member]) -> ConditionUpdate:
    live_sinks = [p for p in obs.pods if p.role is Role.SINK and p.live]
    # Every source trainer rank is a member.
    sources = len(obs.spec.trainer.listed_ranks() if obs.sources is None else obs.sources)
    expected = sources + (0 if obs.spec.mode is SyncMode.COLOCATED else len(live_sinks))
    joined = len(obs.planned) if obs.desired.formable else 0
    if not obs.desired.formable or joined < expected:
        return ConditionUpdate(
            ConditionType.READY, F, reasons.WAITING_FOR_MEMBERS,
            reasons.WAITING_FOR_MEMBERS_MESSAGE.format(joined=joined, expected=expected)
            + (f" Waiting for {obs.desired.waiting_for}." if obs.desired.waiting_for else ""),
        )  # fmt: skip
    current = obs.current.version
    if current is None:
        return ConditionUpdate(
            ConditionType.READY, T, reasons.AWAITING_FIRST_VERSION,
            reasons.AWAITING_FIRST_VERSION_MESSAGE.format(count=joined),
        )  # fmt: skip
    behind = [m for m in sinks if m.version != current]
    if behind:
        return ConditionUpdate(
            ConditionType.READY, F, reasons.MEMBERS_BEHIND,
            reasons.MEMBERS_BEHIND_MESSAGE.format(
                behind=len(behind), count=len(sinks), version=current
            ),
        )  # fmt: skip
    return ConditionUpdate(
        ConditionType.READY, T, reasons.ALL_MEMBERS_CURRENT,
        reasons.ALL_MEMBERS_CURRENT_MESSAGE.format(count=len(sinks), version=current),
    )  # fmt: skip


def _prewarmed(obs: Observation, group: Sequence[Member]) -> ConditionUpdate:
    kind = ConditionType.PREWARMED
    if not obs.spec.prewarm.enabled:
        return ConditionUpdate(kind, F, reasons.PREWARM_DISABLED, reasons.PREWARM_DISABLED_MESSAGE)
    generation = obs.planned_generation
    if generation is None or not group:
        return ConditionUpdate(
            kind, F, reasons.WAITING_FOR_MEMBERS, "No group generation is planned yet."
        )
    cold = [m.rank for m in group if not m.warm]
    if not cold:
        return ConditionUpdate(
            kind, T, reasons.GROUP_WARM,
            reasons.GROUP_WARM_MESSAGE.format(generation=generation, count=len(group)),
        )  # fmt: skip
    if obs.prewarm_timed_out:
        return ConditionUpdate(
            kind, F, reasons.PREWARM_TIMED_OUT,
            reasons.PREWARM_TIMED_OUT_MESSAGE.format(
                generation=generation, seconds=obs.spec.prewarm.timeout_seconds,
                ranks=reasons.listing([str(rank) for rank in cold]),
            ),
        )  # fmt: skip
    return ConditionUpdate(
        kind, F, reasons.WARMING,
        reasons.WARMING_MESSAGE.format(
            generation=generation, warm=len(group) - len(cold), count=len(group)
        ),
    )  # fmt: skip


def _syncing(source: AgentStatus | None, sink_count: int) -> ConditionUpdate:
    if source is not None and source.round_in_progress:
        return ConditionUpdate(
            ConditionType.SYNCING, T, reasons.ROUND_IN_PROGRESS,
            reasons.ROUND_IN_PROGRESS_MESSAGE.format(count=sink_count),
        )  # fmt: skip
    return ConditionUpdate(ConditionType.SYNCING, F, reasons.IDLE, reasons.IDLE_MESSAGE)


def _degraded(obs: Observation, source: AgentStatus | None) -> ConditionUpdate:
    kind = ConditionType.DEGRADED
    bare = sorted(p.name for p in obs.pods if not p.has_agent and p.live)
    if bare:
        return ConditionUpdate(
            kind, T, reasons.SIDECAR_MISSING,
            reasons.SIDECAR_MISSING_MESSAGE.format(pods=reasons.listing(bare)),
        )  # fmt: skip
    refused = sorted(pod for pod, error in obs.agent_errors.items() if error.startswith("HTTP 401"))
    if refused:  # its token is not the operator's: it cannot be planned, gated or recovered
        return ConditionUpdate(
            kind, T, reasons.AGENT_REFUSES_OPERATOR,
            reasons.AGENT_REFUSES_OPERATOR_MESSAGE.format(pods=reasons.listing(refused)),
        )  # fmt: skip
    if obs.skewed:  # they are not planned (`decide`); only their pods' recreation helps
        pods = sorted(obs.skewed)
        return ConditionUpdate(
            kind, T, reasons.AGENT_PROTOCOL_SKEW,
            reasons.AGENT_PROTOCOL_SKEW_MESSAGE.format(
                pods=reasons.listing(pods),
                versions=reasons.listing(sorted({str(obs.skewed[p]) for p in pods})),
                version=PROTOCOL_VERSION, low=PROTOCOL_VERSION - SKEW,
                high=PROTOCOL_VERSION + SKEW,
            ),
        )  # fmt: skip
    for slot in obs.planned:
        broken = _broken(obs.statuses.get(slot.pod), obs.planned_generation)
        error = obs.plan_errors.get(slot.pod) or (broken.error if broken else None)
        if broken or slot.pod in obs.plan_errors:
            return ConditionUpdate(
                kind, T, reasons.MEMBER_FAILED,
                reasons.MEMBER_FAILED_MESSAGE.format(
                    pod=slot.pod, rank=slot.rank, error=error or "generation broken"
                ),
            )  # fmt: skip
    report = source.last_round if source is not None else None
    if report is not None and not report.ok:
        return ConditionUpdate(
            kind, T, reasons.ROUND_FAILED,
            reasons.ROUND_FAILED_MESSAGE.format(
                version=report.version, error=report.message or report.reason
            ),
        )  # fmt: skip
    return ConditionUpdate(kind, F, reasons.AS_EXPECTED, reasons.AS_EXPECTED_MESSAGE)


def _broken(status: AgentStatus | None, generation: int | None) -> GenerationStatus | None:
    """The agent's entry for `generation` if it reports it broken (a loop: every member,
    every pass)."""
    for held in status.generations if status is not None else ():
        if held.generation == generation and held.state is GenerationState.BROKEN:
            return held
    return None


def source_status(obs: Observation) -> AgentStatus | None:
    for slot in obs.planned:
        if slot.role is Role.SOURCE:
            return obs.statuses.get(slot.pod)
    return None


def observed_status(old: WeightSyncStatus, obs: Observation, now: datetime) -> WeightSyncStatus:
    pods = {p.name: p for p in obs.pods}
    group = members(obs.planned, obs.planned_generation, pods, obs.statuses, old.members)
    sinks = [m for m in group if m.role == Role.SINK]
    source = source_status(obs)
    updates = [
        _ready(obs, sinks),
        _prewarmed(obs, group),
        _syncing(source, len(sinks)),
        _degraded(obs, source),
        protocol_condition(
            obs.spec,
            {p.name: obs.statuses[p.name] for p in obs.pods if p.live and p.name in obs.statuses},
        ),
    ]
    conditions = set_conditions(
        old.conditions, updates, observed_generation=obs.metadata_generation, now=now
    )
    return WeightSyncStatus(
        conditions=_ordered(conditions),
        observed_generation=obs.metadata_generation,
        current_version=obs.current.version,
        lineage=obs.current.lineage,
        group_generation=obs.planned_generation,
        member_count=len(group),
        members=group,
        last_round=last_round(source, old.last_round),
        last_failure=last_failure(source, old.last_failure),
    )
