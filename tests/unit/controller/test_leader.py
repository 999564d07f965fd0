"""The elector (`controller.leader`) over an in-memory Lease with the API server's
optimistic concurrency, on a clock the test moves: two replicas never lead at once, a
standby takes over within the bound, a released Lease at once."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes.client.exceptions import ApiException

from weightsync.controller import metrics
from weightsync.controller.leader import Elector
from weightsync.controller.leadership.lease import LeaseRecord, LeaseTiming

TIMING = LeaseTiming()
START = datetime(2026, 11, 28, 20, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def wall(self) -> datetime:
        return START + timedelta(seconds=self.now)


class StoredLease:
    """One Lease as the API server keeps it: each write bumps the version, a write of a
    stale version (or a create of an existing Lease) is a 409."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0

    def write(self, record: LeaseRecord) -> LeaseRecord:
        current = None if self.record is None else self.record.resource_version
        if record.resource_version != current:
            raise ApiException(status=409, reason="Conflict")
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        return self.record


class FakeLeases:
    """A replica's view of `stored`; `reachable` False: every call fails."""

    namespace, name = "weightsync-system", "ws-leader"

    def __init__(self, stored: StoredLease) -> None:
        self.stored = stored
        self.reachable = True

    async def read(self, within: float) -> LeaseRecord | None:
        if not self.reachable:
            raise ConnectionError("API server unreachable")
        return self.stored.record

    async def write(self, record: LeaseRecord, within: float) -> LeaseRecord:
        if not self.reachable:
            raise ConnectionError("API server unreachable")
        return self.stored.write(record)


def replica(name: str, stored: StoredLease, clock: Clock) -> tuple[Elector, FakeLeases]:
    leases = FakeLeases(stored)
    elector = Elector(leases, name, TIMING, clock=lambda: clock.now, wall=clock.wall)  # type: ignore[arg-type]
    return elector, leases


def run(
    replicas: dict[str, Elector], clock: Clock, until: float, *, alive: set[str] | None = None
) -> list[tuple[float, str]]:
    """Step each live replica at the times it asked for, until `until`; every change of
    the set of leaders, and a check that there is never more than one."""
    due = dict.fromkeys(replicas, clock.now)
    changes: list[tuple[float, str]] = []
    leaders = {n for n, e in replicas.items() if e.leading}
    while True:
        live = {n: t for n, t in due.items() if alive is None or n in alive}
        name, when = min(live.items(), key=lambda item: item[1])
        if when > until:
            clock.now = until
            return changes
        clock.now = when
        wait = asyncio.run(replicas[name]._step())
        due[name] = clock.now + max(wait, 0.01)
        now_leading = {n for n, e in replicas.items() if e.leading}
        assert len(now_leading) <= 1, f"two leaders at {clock.now}: {now_leading}"
        if now_leading != leaders:
            changes.append((clock.now, ",".join(sorted(now_leading)) or "-"))
            leaders = now_leading


def test_one_leader_and_a_standby_that_stays_one() -> None:
    stored, clock = StoredLease(), Clock()
    a, _ = replica("a", stored, clock)
    b, _ = replica("b", stored, clock)
    changes = run({"a": a, "b": b}, clock, until=120.0)
    assert changes == [(0.0, "a")]
    assert stored.record is not None
    assert stored.record.holder == "a"
    assert stored.record.transitions == 0


def test_the_standby_takes_over_within_the_bound_after_the_leader_dies() -> None:
    stored, clock = StoredLease(), Clock()
    a, _ = replica("a", stored, clock)
    b, _ = replica("b", stored, clock)
    run({"a": a, "b": b}, clock, until=31.0)
    died = clock.now
    assert stored.record is not None
    assert stored.record.renew_time is not None
    last_renewal = (stored.record.renew_time - START).total_seconds()
    a.leading = False  # the process is gone: it neither renews nor leads
    changes = run({"a": a, "b": b}, clock, until=died + 60.0, alive={"b"})
    assert len(changes) == 1
    took_over, who = changes[0]
    assert who == "b"
    assert took_over - last_renewal >= TIMING.duration_seconds  # the Lease had expired
    assert took_over - died <= TIMING.takeover_bound_seconds
    assert stored.record is not None
    assert stored.record.transitions == 1


def test_a_partitioned_leader_gives_up_before_the_standby_takes_over() -> None:
    stored, clock = StoredLease(), Clock()
    a, a_view = replica("a", stored, clock)
    b, _ = replica("b", stored, clock)
    run({"a": a, "b": b}, clock, until=20.0)
    a_view.reachable = False  # a cannot renew, but still runs
    assert stored.record is not None
    assert stored.record.renew_time is not None
    last_renewal = (stored.record.renew_time - START).total_seconds()
    changes = run({"a": a, "b": b}, clock, until=60.0)
    assert [who for _, who in changes] == ["-", "b"]
    gave_up, took_over = changes[0][0], changes[1][0]
    # Requests take no time here; a real one is cut off after `request_seconds`.
    assert gave_up - last_renewal == pytest.approx(TIMING.give_up_seconds)
    assert took_over - last_renewal >= TIMING.duration_seconds
    assert "no renewal" in a.lost_because


def test_a_released_lease_is_taken_within_one_period() -> None:
    stored, clock = StoredLease(), Clock()
    a, _ = replica("a", stored, clock)
    b, _ = replica("b", stored, clock)
    run({"a": a, "b": b}, clock, until=11.0)
    assert metrics.REGISTRY.get_sample_value("weightsync_operator_leader") == 1.0
    asyncio.run(a.release())
    assert metrics.REGISTRY.get_sample_value("weightsync_operator_leader") == 0.0
    released_at = clock.now
    assert not a.leading
    changes = run({"a": a, "b": b}, clock, until=released_at + 30.0, alive={"b"})
    assert changes[0][1] == "b"
    assert changes[0][0] - released_at <= TIMING.renew_seconds


def test_a_leader_that_finds_another_holder_stops_at_once() -> None:
    stored, clock = StoredLease(), Clock()
    a, _ = replica("a", stored, clock)
    run({"a": a}, clock, until=3.0)
    assert stored.record is not None
    stored.write(replace(stored.record, holder="intruder"))  # e.g. a forced kubectl edit
    asyncio.run(a._step())
    assert not a.leading
    assert "intruder" in a.lost_because
