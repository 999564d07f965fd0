"""Condition helpers: Kubernetes semantics for lastTransitionTime and observedGeneration."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from weightsync.api import reasons
from weightsync.api.base import format_timestamp, utc_now
from weightsync.api.conditions import (
    Condition,
    ConditionStatus,
    ConditionType,
    ConditionUpdate,
    find_condition,
    is_true,
    set_condition,
    set_conditions,
)

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)

READY = ConditionUpdate(
    ConditionType.READY,
    ConditionStatus.TRUE,
    reasons.ALL_MEMBERS_CURRENT,
    reasons.ALL_MEMBERS_CURRENT_MESSAGE.format(count=2, version=7),
)
NOT_READY = ConditionUpdate(
    ConditionType.READY,
    ConditionStatus.FALSE,
    reasons.MEMBERS_BEHIND,
    reasons.MEMBERS_BEHIND_MESSAGE.format(behind=1, count=2, version=8),
)


def test_new_condition_starts_its_transition_now() -> None:
    [condition] = set_condition([], READY, observed_generation=1, now=T0)
    assert condition == Condition(
        type="Ready",
        status=ConditionStatus.TRUE,
        reason="AllMembersCurrent",
        message="All 2 sink ranks serve version 7.",
        observed_generation=1,
        last_transition_time=T0,
    )


def test_same_status_keeps_transition_time_but_takes_new_reason_and_generation() -> None:
    conditions = set_condition([], READY, observed_generation=1, now=T0)
    rewritten = ConditionUpdate(ConditionType.READY, ConditionStatus.TRUE, "Other", "changed")
    [condition] = set_condition(conditions, rewritten, observed_generation=2, now=T1)
    assert condition.last_transition_time == T0
    assert (condition.reason, condition.message, condition.observed_generation) == (
        "Other",
        "changed",
        2,
    )


def test_status_flip_moves_transition_time() -> None:
    conditions = set_condition([], READY, observed_generation=1, now=T0)
    [condition] = set_condition(conditions, NOT_READY, observed_generation=1, now=T1)
    assert condition.status is ConditionStatus.FALSE
    assert condition.last_transition_time == T1


def test_flip_to_unknown_and_back_moves_it_each_time() -> None:
    t2 = T1 + timedelta(minutes=1)
    unknown = ConditionUpdate(ConditionType.READY, ConditionStatus.UNKNOWN, "Reconciling")
    conditions = set_condition([], READY, observed_generation=1, now=T0)
    conditions = set_condition(conditions, unknown, observed_generation=1, now=T1)
    conditions = set_condition(conditions, READY, observed_generation=1, now=t2)
    assert conditions[0].last_transition_time == t2


def test_other_conditions_and_their_order_are_kept() -> None:
    warm = ConditionUpdate(ConditionType.PREWARMED, ConditionStatus.TRUE, reasons.GROUP_WARM)
    idle = ConditionUpdate(ConditionType.SYNCING, ConditionStatus.FALSE, reasons.IDLE)
    conditions = set_conditions([], [READY, warm, idle], observed_generation=3, now=T0)
    updated = set_condition(conditions, NOT_READY, observed_generation=4, now=T1)
    assert [condition.type for condition in updated] == ["Ready", "Prewarmed", "Syncing"]
    assert updated[1:] == conditions[1:]
    assert updated[0].observed_generation == 4


def test_input_list_is_not_modified() -> None:
    conditions = set_condition([], READY, observed_generation=1, now=T0)
    snapshot = list(conditions)
    degraded = ConditionUpdate(ConditionType.DEGRADED, ConditionStatus.FALSE, reasons.AS_EXPECTED)
    set_condition(conditions, NOT_READY, observed_generation=2, now=T1)
    set_condition(conditions, degraded, observed_generation=2, now=T1)
    assert conditions == snapshot


def test_set_conditions_stamps_one_generation_on_all() -> None:
    updates = [
        ConditionUpdate(kind, ConditionStatus.UNKNOWN, "Reconciling") for kind in ConditionType
    ]
    conditions = set_conditions([], updates, observed_generation=5, now=T0)
    assert [c.type for c in conditions] == [
        "Ready",
        "Prewarmed",
        "Syncing",
        "Degraded",
        "RecoveryProtocol",
    ]
    assert {c.observed_generation for c in conditions} == {5}


def test_find_and_is_true() -> None:
    conditions = set_condition([], READY, observed_generation=1, now=T0)
    found = find_condition(conditions, ConditionType.READY)
    assert found is not None
    assert found.reason == "AllMembersCurrent"
    assert find_condition(conditions, ConditionType.DEGRADED) is None
    assert is_true(conditions, ConditionType.READY)
    assert not is_true(conditions, ConditionType.DEGRADED)
    assert not is_true(set_condition(conditions, NOT_READY, observed_generation=1, now=T1), "Ready")


def test_serialised_condition_is_what_the_api_server_stores() -> None:
    [condition] = set_condition([], READY, observed_generation=1, now=T0)
    assert condition.to_k8s() == {
        "type": "Ready",
        "status": "True",
        "observedGeneration": 1,
        "lastTransitionTime": "2026-01-02T03:04:05Z",
        "reason": "AllMembersCurrent",
        "message": "All 2 sink ranks serve version 7.",
    }
    assert Condition.model_validate(condition.to_k8s()) == condition


def test_timestamps_are_whole_seconds_in_utc() -> None:
    now = utc_now()
    assert now.microsecond == 0
    assert now.tzinfo is UTC
    two_hours_east = timezone(timedelta(hours=2))
    local = datetime(2026, 1, 2, 6, 4, 5, 999, tzinfo=two_hours_east)
    assert format_timestamp(local) == "2026-01-02T04:04:05Z"


def _reason_constants() -> list[str]:
    return [
        value
        for name, value in vars(reasons).items()
        if name.isupper() and not name.endswith("_MESSAGE")
    ]


@pytest.mark.parametrize("reason", _reason_constants())
def test_reasons_are_valid_condition_reasons(reason: str) -> None:
    Condition(
        type="Ready",
        status=ConditionStatus.TRUE,
        reason=reason,
        message="",
        observed_generation=0,
        last_transition_time=T0,
    )
    assert reason[0].isupper()


def test_every_reason_has_a_message() -> None:
    names = vars(reasons)
    for name, value in names.items():
        if name.isupper() and not name.endswith("_MESSAGE"):
            assert isinstance(names.get(f"{name}_MESSAGE"), str), f"{name} ({value}) has no message"


def test_invalid_reason_is_rejected() -> None:
    with pytest.raises(ValueError, match="reason"):
        Condition(
            type="Ready",
            status=ConditionStatus.TRUE,
            reason="not a reason",
            message="",
            observed_generation=0,
            last_transition_time=T0,
        )
