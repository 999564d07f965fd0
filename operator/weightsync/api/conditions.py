"""Status conditions with Kubernetes semantics.

A condition's `lastTransitionTime` moves only when its `status` flips; its reason,
message and observedGeneration follow every write. The helpers are pure: they
return a new list, so a reconcile pass can build the whole status, compare it
with the stored one, and write it once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from pydantic import Field

from weightsync.api.base import ApiModel, Int64, Timestamp

# metav1.Condition's own bounds, so our conditions read like every other controller's.
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class ConditionType(StrEnum):
    """The condition types a WeightSync reports."""

    READY = "Ready"
    """Every inference member serves the current version (or there is none yet to serve)."""
    PREWARMED = "Prewarmed"
    """The current group generation finished its warm-up collective on every rank."""
    SYNCING = "Syncing"
    """A round is in progress."""
    DEGRADED = "Degraded"
    """Some member is failed, recovering or behind; rounds may still run for the others."""
    RECOVERY_PROTOCOL = "RecoveryProtocol"
    """Every agent pulls and holds over one working P2P protocol, named by the reason."""


class ConditionStatus(StrEnum):
    """The status of a condition."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One aspect of a WeightSync's state (the shape of Kubernetes `metav1.Condition`)."""

    type: str = Field(max_length=316, pattern=CONDITION_TYPE_PATTERN)
    """type is the condition's type: Ready, Prewarmed, Syncing, Degraded or
    RecoveryProtocol."""

    status: ConditionStatus
    """status is True, False or Unknown."""

    observed_generation: Int64
    """observedGeneration is the metadata.generation of the spec this condition was computed
    from."""

    last_transition_time: Timestamp
    """lastTransitionTime is when status last changed (not when the condition was last
    written)."""

    reason: str = Field(min_length=1, max_length=1024, pattern=REASON_PATTERN)
    """reason is a CamelCase word for why the condition has its status, for programs."""

    message: str = Field(max_length=32768)
    """message says why the condition has its status, for humans; it may be empty."""


@dataclass(frozen=True)
class ConditionUpdate:
    """The new state of one condition type, without the bookkeeping fields."""

    type: ConditionType
    status: ConditionStatus
    reason: str
    message: str = ""


def find_condition(conditions: Iterable[Condition], type_: str) -> Condition | None:
    """The condition of `type_`, or None."""
    return next((condition for condition in conditions if condition.type == type_), None)


def is_true(conditions: Iterable[Condition], type_: str) -> bool:
    """Whether the condition of `type_` exists and is True."""
    condition = find_condition(conditions, type_)
    return condition is not None and condition.status is ConditionStatus.TRUE


def set_condition(
    conditions: Sequence[Condition],
    update: ConditionUpdate,
    *,
    observed_generation: int,
    now: datetime,
) -> list[Condition]:
    """`conditions` with `update` applied; other conditions and their order are kept.

    `lastTransitionTime` is `now` for a new condition or a status flip, and the stored
    time otherwise.
    """
    previous = find_condition(conditions, update.type)
    transition_time = (
        previous.last_transition_time
        if previous is not None and previous.status is update.status
        else now
    )
    updated = Condition(
        type=update.type,
        status=update.status,
        reason=update.reason,
        message=update.message,
        observed_generation=observed_generation,
        last_transition_time=transition_time,
    )
    if previous is None:
        return [*conditions, updated]
    return [updated if condition.type == update.type else condition for condition in conditions]


def set_conditions(
    conditions: Sequence[Condition],
    updates: Iterable[ConditionUpdate],
    *,
    observed_generation: int,
    now: datetime,
) -> list[Condition]:
    """`conditions` with every update applied in turn (see `set_condition`)."""
    result = list(conditions)
    for update in updates:
        result = set_condition(result, update, observed_generation=observed_generation, now=now)
    return result
