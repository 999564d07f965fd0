"""The Events a pass posts: for state transitions only. Pure.

A WeightSync's status changes at every round (Syncing flips, the last round moves on);
an Event for each change was three a round, a storm at one round a second. Events say
what changed state: a condition's (status, reason) other than Syncing's per-round flips,
a round failing after one succeeded, the first version synced after a failure (or ever),
a new trainer lineage. Every round is in `status.lastRound` and the metrics.
"""

from __future__ import annotations

from weightsync.api import reasons
from weightsync.api.conditions import ConditionStatus, ConditionType, find_condition
from weightsync.api.v1alpha1 import WeightSyncStatus
from weightsync.controller.status.observed import USER_ERRORS, EventSpec, T

# Syncing's reasons that change with each round.
_PER_ROUND = frozenset({reasons.ROUND_IN_PROGRESS, reasons.IDLE})
# RecoveryProtocol's reasons that mean pulls cannot work for some pods.
_PULLS_BROKEN = frozenset({reasons.PROTOCOLS_DIFFER, reasons.PROTOCOL_UNAVAILABLE})


def _healthy(status: WeightSyncStatus) -> bool:
    """Whether the last round known to `status` succeeded (none yet counts as not)."""
    done, failed = status.last_round, status.last_failure
    return done is not None and (failed is None or failed.time <= done.completion_time)


def transition_events(old: WeightSyncStatus, new: WeightSyncStatus) -> list[EventSpec]:
    """The Events for going from `old` to `new` (see the module doc)."""
    events = []
    ready = find_condition(new.conditions, ConditionType.READY)
    for condition in new.conditions:
        if condition.type == ConditionType.SYNCING and condition.reason in _PER_ROUND:
            continue
        if condition.type != ConditionType.READY and ready and condition.reason == ready.reason:
            continue  # the same cause as Ready's (a spec problem): one Event says it
        before = find_condition(old.conditions, condition.type)
        if before is not None and (before.status, before.reason) == (
            condition.status,
            condition.reason,
        ):
            continue
        if condition.status is ConditionStatus.UNKNOWN:
            continue
        warning = (
            (condition.type == ConditionType.READY and condition.reason in USER_ERRORS)
            or (condition.type == ConditionType.DEGRADED and condition.status is T)
            or condition.reason == reasons.PREWARM_TIMED_OUT
            or (
                condition.type == ConditionType.RECOVERY_PROTOCOL
                and condition.reason in _PULLS_BROKEN
            )
        )
        events.append(
            EventSpec(
                "Warning" if warning else "Normal",
                condition.reason,
                f"{condition.type}={condition.status.value}: {condition.message}",
            )
        )
    failure = new.last_failure
    if failure is not None and failure != old.last_failure and _healthy(old):
        events.append(
            EventSpec(
                "Warning",
                reasons.ROUND_FAILED,
                reasons.ROUND_FAILED_EVENT_MESSAGE.format(
                    version=failure.version,
                    member=failure.member or "the source",
                    stage=failure.stage or "unknown",
                    reason=failure.reason,
                    message=failure.message,
                ),
            )
        )
    if old.lineage is not None and new.lineage is not None and new.lineage != old.lineage:
        events.append(
            EventSpec(
                "Normal",
                reasons.NEW_LINEAGE,
                reasons.NEW_LINEAGE_MESSAGE.format(
                    version=new.current_version, previous=old.current_version
                ),
            )
        )
    round_ = new.last_round
    if round_ is not None and round_ != old.last_round and not _healthy(old) and _healthy(new):
        events.append(
            EventSpec(
                "Normal",
                reasons.VERSION_SYNCED,
                reasons.VERSION_SYNCED_MESSAGE.format(
                    version=round_.version, millis=round_.duration_millis, bytes=round_.bytes
                ),
            )
        )
    return events
