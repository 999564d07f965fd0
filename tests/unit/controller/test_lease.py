"""Leader election's decisions (`leadership.lease`), without I/O: acquire, renew, stand
by, lose; expiry judged by the observer's own clock (skew), and a released Lease."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from weightsync.controller.leadership.lease import (
    RELEASED_DURATION_SECONDS,
    LeaseRecord,
    LeaseTiming,
    Sighting,
    Verdict,
    decide,
    must_give_up,
    released,
)

TIMING = LeaseTiming()
WALL = datetime(2026, 11, 28, 20, 0, 0, 123456, tzinfo=UTC)


def held_by(holder: str, version: str = "7", **changes: object) -> LeaseRecord:
    lease = LeaseRecord(holder, TIMING.duration_seconds, WALL, WALL, 3, version)
    return replace(lease, **changes)  # type: ignore[arg-type]


def look(
    lease: LeaseRecord | None,
    *,
    now: float,
    seen: Sighting | None = None,
    me: str = "b",
    leading: bool = False,
    wall: datetime = WALL,
) -> tuple[Verdict, LeaseRecord | None, Sighting | None, float]:
    decision = decide(lease, me=me, leading=leading, now=now, wall=wall, seen=seen, timing=TIMING)
    return decision.verdict, decision.write, decision.sighting, decision.wait_seconds


def test_no_lease_yet_is_created_with_us_as_holder() -> None:
    verdict, write, _, wait = look(None, now=100.0)
    assert verdict is Verdict.ACQUIRE
    assert write == LeaseRecord("b", TIMING.duration_seconds, WALL, WALL, 0, None)
    assert wait == TIMING.renew_seconds


def test_a_live_lease_of_another_replica_is_waited_on() -> None:
    verdict, write, seen, wait = look(held_by("a"), now=100.0)
    assert (verdict, write) == (Verdict.STANDBY, None)
    assert seen == Sighting("7", 100.0)
    assert wait == TIMING.renew_seconds


def test_an_unrenewed_lease_is_taken_a_duration_after_it_was_first_seen() -> None:
    lease = held_by("a")
    seen = Sighting("7", 100.0)
    just_before = 100.0 + TIMING.duration_seconds - 0.5
    verdict, _, _, wait = look(lease, now=just_before, seen=seen)
    assert verdict is Verdict.STANDBY
    assert wait == pytest.approx(0.5)  # the next look is timed to the expiry
    later = WALL + timedelta(seconds=11)
    verdict, write, _, _ = look(lease, now=100.0 + TIMING.duration_seconds, seen=seen, wall=later)
    assert verdict is Verdict.ACQUIRE
    assert write == LeaseRecord("b", TIMING.duration_seconds, later, later, 4, "7")


def test_a_lease_renewed_at_every_look_is_never_taken() -> None:
    seen = None
    for step in range(100):  # 200 s of renewals, each a new version
        verdict, _, seen, _ = look(held_by("a", version=str(step)), now=2.0 * step, seen=seen)
        assert verdict is Verdict.STANDBY


def test_expiry_ignores_the_holders_wall_clock_in_both_directions() -> None:
    """Nodes' clocks differ: only when this process saw the Lease change counts."""
    long_ago = held_by("a", renew_time=WALL - timedelta(hours=1))  # holder's clock behind
    assert look(long_ago, now=100.0)[0] is Verdict.STANDBY  # just renewed, as seen here
    ahead = held_by("a", renew_time=WALL + timedelta(hours=1))  # holder's clock ahead
    seen = Sighting("7", 100.0)
    assert look(ahead, now=100.0 + TIMING.duration_seconds, seen=seen)[0] is Verdict.ACQUIRE


def test_the_holder_renews_keeping_its_acquire_time_and_transitions() -> None:
    later = WALL + timedelta(seconds=2)
    verdict, write, _, wait = look(held_by("b"), now=100.0, leading=True, wall=later)
    assert verdict is Verdict.RENEW
    assert write == held_by("b", renew_time=later)
    assert wait == TIMING.renew_seconds


def test_a_restarted_container_takes_its_own_lease_back_at_once() -> None:
    verdict, write, _, _ = look(held_by("b"), now=100.0, leading=False)
    assert verdict is Verdict.ACQUIRE
    assert write is not None
    assert write.transitions == 3  # the same holder: no transition


def test_a_leader_that_finds_another_holder_has_lost() -> None:
    verdict, write, _, wait = look(held_by("a"), now=100.0, leading=True)
    assert (verdict, write, wait) == (Verdict.LOST, None, 0.0)


def test_a_released_lease_is_taken_at_once() -> None:
    handed_back = released(held_by("a"), WALL)
    assert handed_back.holder == ""
    assert handed_back.duration_seconds == RELEASED_DURATION_SECONDS
    assert handed_back.transitions == 3
    assert handed_back.resource_version == "7"  # replaced conditionally
    verdict, write, _, _ = look(replace(handed_back, resource_version="8"), now=100.0)
    assert verdict is Verdict.ACQUIRE
    assert write is not None
    assert (write.holder, write.transitions, write.resource_version) == ("b", 4, "8")


def test_a_holder_gives_up_before_anyone_may_take_over() -> None:
    sent = 100.0
    assert not must_give_up(sent, sent + TIMING.give_up_seconds - 0.1, TIMING)
    assert must_give_up(sent, sent + TIMING.give_up_seconds, TIMING)
    # Giving up is noticed within one request of it; a standby that saw the renewal
    # (stored after `sent`) waits a whole duration: the two never overlap.
    assert TIMING.give_up_seconds + TIMING.request_seconds < TIMING.duration_seconds


def test_the_takeover_bound_is_fifteen_seconds() -> None:
    assert TIMING.takeover_bound_seconds <= 15.0


@pytest.mark.parametrize(
    "bad",
    [
        {"give_up_seconds": 2.0},  # no renewal fits before giving up
        {"give_up_seconds": 9.0},  # gives up too close to a takeover
    ],
)
def test_unsafe_timings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="giv"):
        LeaseTiming(**bad)  # type: ignore[arg-type]


def test_the_record_round_trips_through_the_lease_object() -> None:
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "ws-leader", "resourceVersion": "42"},
        "spec": {
            "holderIdentity": "ws-operator-abc",
            "leaseDurationSeconds": 10,
            "acquireTime": "2026-11-28T20:00:00.123456Z",
            "renewTime": "2026-11-28T20:00:04.000000Z",
            "leaseTransitions": 2,
        },
    }
    record = LeaseRecord.from_object(lease)
    assert record.holder == "ws-operator-abc"
    assert record.acquire_time == WALL
    assert record.resource_version == "42"
    assert record.spec() == lease["spec"]
    assert LeaseRecord.from_object({"metadata": {}, "spec": {}}) == LeaseRecord()
    assert released(record, WALL).spec()["holderIdentity"] is None
