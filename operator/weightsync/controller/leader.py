"""Leader election's effects: read the Lease, write what `leadership.lease` decided, and
say when this replica leads and when it must stop.

`Elector.acquire` returns once this replica holds the Lease; `Elector.hold` renews it and
returns only when leadership is lost (another holder, or no renewal for
`give_up_seconds`), after which the caller must stop reconciling at once: `main` ends the
process, and the kubelet starts it again as a standby. `release` hands the Lease back on a
clean stop, so that a standby takes over within one period instead of a whole duration.
The gauge `weightsync_operator_leader` follows (1 while leading).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from kubernetes.client.exceptions import ApiException

from weightsync.controller import metrics
from weightsync.controller.cluster.leases import Leases
from weightsync.controller.leadership.lease import (
    LeaseRecord,
    LeaseTiming,
    Sighting,
    Verdict,
    decide,
    must_give_up,
    released,
)

log = logging.getLogger(__name__)

# What a failed read or write of the Lease raises: refused (409 among them), not reached,
# or cut off after `request_seconds`.
_LEASE_ERRORS = (ApiException, ConnectionError, OSError, TimeoutError)


class Elector:
    """This replica's side of the election for the Lease behind `leases`."""

    def __init__(
        self,
        leases: Leases,
        identity: str,
        timing: LeaseTiming | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.leases = leases
        self.identity = identity
        self.timing = timing or LeaseTiming()
        self.leading = False
        self.lost_because = ""
        self._clock, self._wall = clock, wall
        self._seen: Sighting | None = None
        self._stored: LeaseRecord | None = None  # our last write, what `release` replaces
        self._renewal_sent = 0.0  # when the last successful write was sent (monotonic)
        metrics.LEADER.set(0)

    async def acquire(self) -> None:
        """Return once this replica holds the Lease (standing by until then)."""
        await self._until(leading=True)

    async def hold(self) -> None:
        """Renew the Lease; return when leadership is lost (`lost_because` says why)."""
        await self._until(leading=False)

    async def _until(self, *, leading: bool) -> None:
        while True:
            wait = await self._step()
            if self.leading is leading:
                return
            await asyncio.sleep(wait)

    async def _step(self) -> float:
        """One look at the Lease and the write decided; seconds until the next."""
        timing = self.timing
        sent = self._clock()
        try:
            lease = await self.leases.read(timing.request_seconds)
            decision = decide(
                lease,
                me=self.identity,
                leading=self.leading,
                now=self._clock(),
                wall=self._wall(),
                seen=self._seen,
                timing=timing,
            )
            self._seen = decision.sighting
            if decision.verdict is Verdict.LOST:
                self._lose(f"the Lease is held by {lease.holder if lease else None!r}")
                return 0.0
            if decision.write is not None:
                self._stored = await self.leases.write(decision.write, timing.request_seconds)
                self._seen = Sighting(self._stored.resource_version, self._clock())
                self._renewal_sent = sent
                if not self.leading:
                    self._lead(lease)
        except _LEASE_ERRORS as error:
            if self.leading and must_give_up(self._renewal_sent, self._clock(), timing):
                self._lose(f"no renewal for {timing.give_up_seconds:g} s ({error!r})")
                return 0.0
            if not (isinstance(error, ApiException) and error.status == 409):
                log.warning("could not read or write the leader Lease: %r", error)
            if self.leading:  # try again by the give-up deadline: it is checked then
                deadline = self._renewal_sent + timing.give_up_seconds
                return min(timing.renew_seconds, max(0.0, deadline - self._clock()))
            return timing.renew_seconds
        return decision.wait_seconds

    def _lead(self, before: LeaseRecord | None) -> None:
        self.leading = True
        metrics.LEADER.set(1)
        previous = before.holder if before is not None and before.holder else "nobody"
        log.info(
            "leading: %s holds Lease %s/%s (before: %s)",
            self.identity, self.leases.namespace, self.leases.name, previous,
        )  # fmt: skip

    def _lose(self, why: str) -> None:
        self.leading = False
        self.lost_because = why
        metrics.LEADER.set(0)
        log.error("lost the leader Lease: %s", why)

    async def release(self) -> None:
        """Hand the Lease back (a clean stop): a standby takes it at its next look."""
        stored, self._stored = self._stored, None
        if not self.leading or stored is None:
            return
        self.leading = False
        metrics.LEADER.set(0)
        try:
            await self.leases.write(released(stored, self._wall()), self.timing.request_seconds)
        except _LEASE_ERRORS as error:  # the Lease then expires: a standby waits it out
            log.warning("could not release the leader Lease: %r", error)
            return
        log.info("released the leader Lease %s/%s", self.leases.namespace, self.leases.name)
