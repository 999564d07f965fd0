"""Leader election over a `coordination.k8s.io/v1` Lease: what to do next, without I/O.

Two operator replicas serve admission; one of them, the holder of the Lease, reconciles.
This is Kubernetes' own scheme (client-go's `leaderelection`, the Lease fields it
writes): the holder renews `renewTime` every `renew_seconds`; a standby takes the Lease
once it has seen it unchanged for `leaseDurationSeconds`, or at once when it is released
(empty `holderIdentity`). Every write carries the `resourceVersion` it read, so of two
replicas that decide to take the same Lease the API server lets one through (409 for the
other).

Why expiry is judged from when *this* process saw the Lease last change, by its own
monotonic clock, and never by comparing the holder's `renewTime` with our wall clock:
nodes' clocks differ. A standby whose clock runs minutes ahead would otherwise take a
Lease that is being renewed; one whose clock is behind would wait minutes after the
holder died. Only the *rate* of the two clocks matters here, and `give_up_seconds` <
`duration_seconds` leaves room for it (`LeaseTiming`).

A holder that could not renew for `give_up_seconds` (counted from when it *sent* its
last successful renewal, which is no later than the API server stored it, and so no
later than any standby saw it) stops reconciling then: before any standby may take over
(`duration_seconds` after it saw that renewal). Stopping is the process' exit
(`controller.leader`): two active replicas never overlap.

The bound on a takeover, after the holder dies without releasing: its last renewal was
stored at some t0 before it died; a standby polls every `renew_seconds`, so it sees that
version by t0 + `renew_seconds` and takes over exactly `duration_seconds` after that
sighting (its next look is timed to the expiry): at most `duration_seconds` +
`renew_seconds` after the holder died, plus a read and a write (each cut off at
`request_seconds`): 12 s with the defaults and a healthy API server, 15 s at worst
(`LeaseTiming.takeover_bound_seconds`). After a clean stop the holder releases the
Lease: a standby takes it within `renew_seconds` and a write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

# The Lease's time fields are MicroTime: RFC 3339 with microseconds.
_MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"
# A released Lease (client-go's convention): no holder, one second of duration.
RELEASED_DURATION_SECONDS = 1


@dataclass(frozen=True)
class LeaseTiming:
    """How often the holder renews and standbys look, how long a Lease lasts unrenewed,
    and when a holder that cannot renew gives up (before anyone may take over)."""

    duration_seconds: int = 10  # `leaseDurationSeconds`
    renew_seconds: float = 2.0  # the holder renews, a standby looks, this often
    give_up_seconds: float = 6.0  # a holder unrenewed this long stops reconciling
    request_seconds: float = 1.5  # one read or write of the Lease, at most

    def __post_init__(self) -> None:
        # The margin between giving up and a possible takeover absorbs one request in
        # flight and the two clocks' different rates.
        if not self.renew_seconds + self.request_seconds <= self.give_up_seconds:
            raise ValueError("a holder must get at least one renewal in before giving up")
        if not self.give_up_seconds + self.request_seconds < self.duration_seconds:
            raise ValueError("give_up_seconds must end well before the Lease may be taken")

    @property
    def takeover_bound_seconds(self) -> float:
        """After the holder dies without releasing, a standby holds the Lease by then: it
        sees the last renewal within a period and a read, and writes after the duration."""
        return self.duration_seconds + self.renew_seconds + 2 * self.request_seconds


def format_time(when: datetime) -> str:
    return when.astimezone(UTC).strftime(_MICROTIME)


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec as leader election reads and writes it, and the version read."""

    holder: str = ""  # `holderIdentity`; empty: released (or never held)
    duration_seconds: int = 0
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0  # `leaseTransitions`: how often the holder changed
    resource_version: str | None = None  # what a replace is conditional on

    @classmethod
    def from_object(cls, lease: Mapping[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=parse_time(spec.get("acquireTime")),
            renew_time=parse_time(spec.get("renewTime")),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=(lease.get("metadata") or {}).get("resourceVersion"),
        )

    def spec(self) -> dict[str, Any]:
        """The Lease's spec to write."""
        times = {
            "acquireTime": format_time(self.acquire_time) if self.acquire_time else None,
            "renewTime": format_time(self.renew_time) if self.renew_time else None,
        }
        return {
            "holderIdentity": self.holder or None,
            "leaseDurationSeconds": self.duration_seconds,
            **{key: value for key, value in times.items() if value is not None},
            "leaseTransitions": self.transitions,
        }


@dataclass(frozen=True)
class Sighting:
    """The Lease version this process saw last, and when it first saw it (monotonic s)."""

    resource_version: str | None
    at: float


class Verdict(StrEnum):
    ACQUIRE = "acquire"  # write `write`; once it succeeds, start reconciling
    RENEW = "renew"  # write `write`; we keep reconciling
    STANDBY = "standby"  # another replica holds a live Lease: serve admission only
    LOST = "lost"  # we were reconciling and another replica holds the Lease: stop now


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    write: LeaseRecord | None  # to create (no Lease yet) or to replace (its version read)
    sighting: Sighting | None  # what to remember for the next decision
    wait_seconds: float  # until the next look


def decide(
    lease: LeaseRecord | None,
    *,
    me: str,
    leading: bool,
    now: float,
    wall: datetime,
    seen: Sighting | None,
    timing: LeaseTiming,
) -> Decision:
    """What to do with the Lease as read (`None`: there is none) at monotonic `now`
    (`wall`: the wall-clock time written into it), `leading` being whether this process
    reconciles now and `seen` what it remembered from its last look."""
    if lease is None:
        fresh = LeaseRecord(me, timing.duration_seconds, wall, wall, 0)
        return Decision(Verdict.ACQUIRE, fresh, None, timing.renew_seconds)
    if seen is None or seen.resource_version != lease.resource_version:
        seen = Sighting(lease.resource_version, now)
    if lease.holder == me:
        # Ours: renew it. A process that finds its own name on a Lease it does not lead
        # by is this pod's container restarted: the one that held it is gone.
        renewed = replace(lease, duration_seconds=timing.duration_seconds, renew_time=wall)
        verdict = Verdict.RENEW if leading else Verdict.ACQUIRE
        return Decision(verdict, renewed, seen, timing.renew_seconds)
    if leading:
        return Decision(Verdict.LOST, None, seen, 0.0)
    expires_in = seen.at + lease.duration_seconds - now
    if lease.holder and expires_in > 0:
        # Look again at the next period, or exactly when it would expire if sooner.
        return Decision(Verdict.STANDBY, None, seen, min(timing.renew_seconds, expires_in))
    taken = replace(
        lease,
        holder=me,
        duration_seconds=timing.duration_seconds,
        acquire_time=wall,
        renew_time=wall,
        transitions=lease.transitions + 1,
    )
    return Decision(Verdict.ACQUIRE, taken, seen, timing.renew_seconds)


def must_give_up(last_renewal_sent: float, now: float, timing: LeaseTiming) -> bool:
    """A holder whose last successful renewal was sent at `last_renewal_sent` (monotonic)
    stops reconciling now: a standby may take over `duration_seconds` after it."""
    return now - last_renewal_sent >= timing.give_up_seconds


def released(lease: LeaseRecord, wall: datetime) -> LeaseRecord:
    """The Lease handed back by its holder on a clean stop: a standby takes it at once."""
    return replace(
        lease,
        holder="",
        duration_seconds=RELEASED_DURATION_SECONDS,
        acquire_time=wall,
        renew_time=wall,
    )
