"""What the local engine serves, as far as its agent can vouch for it.

The engine's own word is not enough: an engine whose container was restarted in place
comes back at the same address with whatever it loaded at start, and may report a
version it never received from us. So the agent records what it loaded into which
engine process (`Loaded`: the incarnation, lineage and version of the last commit or
recovery), polls the engine's health in the background, and vouches for a version only
while the same process answers, healthy and whole. The control API reads the last poll
(never waits on the engine: a frozen engine must not freeze `/v1/status`).

An engine loaded by a peer (Colocated: the trainer's agent hands buckets to it) is
vouched for by what this agent saw happen: a version the engine process reports after
the one it started with was loaded through the update API, by that peer. The version it
reports at start is never vouched for.

The same record answers the kubelet's readiness probe of the engine container
(`readiness`, through `agent.engine_ready`): once this agent has loaded the engine, a
process it cannot vouch for is not ready, so a restarted engine stays out of its
Service until a round or a recovery loads it, whatever the pod's gate last said.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from weightsync.api.control import EngineStatus
from weightsync.engines.base import EngineAdapter, EngineError, EngineHealth

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0  # how often the engine's health is read
HEALTH_TIMEOUT_SECONDS = 2.0  # a poll that takes longer counts as unreachable
STALE_SECONDS = 3.0  # a last poll older than this vouches for nothing
# A last poll older than this makes the engine container not ready: longer than
# `STALE_SECONDS`, so a busy agent's late poll does not flap the pod's readiness.
READY_STALE_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Loaded:
    """A version this agent loaded into one engine process."""

    incarnation: str | None
    lineage: str
    version: int
    at: float  # wall-clock time of the load: the operator checks the engine container
    # has not started since (`readiness.loaded_before_start`)


class EngineWatch:
    def __init__(self, adapter: EngineAdapter, *, loaded_by_peer: bool = False) -> None:
        self.adapter = adapter
        self.health: EngineHealth | None = None
        self.checked_at = 0.0  # monotonic time of the last completed poll
        self.loaded: Loaded | None = None
        self._restarts_seen: set[str] = set()
        self._loaded_by_peer = loaded_by_peer
        self._started_with: tuple[str | None, int | None] | None = None
        self._ever_loaded = False  # a version was loaded: start-up weights no longer do
        self._commits = 0  # commits so far: a poll begun before the last one is stale

    def committed(self, lineage: str, version: int) -> None:
        """A round or a recovery made the attached engine process serve `version`.

        The commit was the engine's own answer, so it counts as a fresh poll: a
        vouched version must not wait for the next background poll to show.
        """
        incarnation = self.adapter.attached_to
        self.loaded = Loaded(incarnation, lineage, version, time.time())
        self._commits += 1
        self._ever_loaded = True
        # An engine that names no incarnation is vouched for by the version it reports
        # (`vouched`): the commit read it back, so the last poll's older one must not
        # close the pod's gate until the next poll.
        nameless = self.health is not None and self.health.incarnation is None
        if incarnation is not None or nameless:
            self.health = EngineHealth(True, version, incarnation=incarnation)
            self.checked_at = time.monotonic()

    async def poll(self) -> EngineHealth:
        commits = self._commits
        try:
            health = await asyncio.wait_for(self.adapter.health(), HEALTH_TIMEOUT_SECONDS)
        except TimeoutError:
            health = EngineHealth(False, None, detail="health timed out")
        except EngineError as exc:
            health = EngineHealth(False, None, detail=str(exc))
        if commits != self._commits:
            # Asked mid-round, answered after the commit: it read the previous or the
            # partial label. Kept, it unvouched a current engine until the next poll, and
            # an operator pass then started a recovery whose pause aborted the engine's
            # requests (SGLang ended a generation early, seen twice in CI).
            return health
        self.health, self.checked_at = health, time.monotonic()
        if self._loaded_by_peer and health.healthy:
            self._observe_peer(health)
        loaded = self.loaded
        if (
            loaded is not None
            and health.incarnation is not None
            and health.incarnation != loaded.incarnation
            and health.incarnation not in self._restarts_seen
        ):
            self._restarts_seen.add(health.incarnation)
            log.warning(
                "engine restarted (incarnation %s): it no longer serves version %d",
                health.incarnation[:8],
                loaded.version,
            )
        return health

    def _observe_peer(self, health: EngineHealth) -> None:
        started = self._started_with
        if started is None or started[0] != health.incarnation:  # first sight of a process
            self._started_with = (health.incarnation, health.version)
            return
        if health.version is not None and health.version != started[1] and not health.torn:
            self.loaded = Loaded(health.incarnation, "", health.version, time.time())
            self._ever_loaded = True

    async def run_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(POLL_SECONDS)

    def vouched(self) -> Loaded | None:
        """The version the engine serves, if this agent can vouch for it now."""
        if time.monotonic() - self.checked_at > STALE_SECONDS:
            return None
        return self._vouchable()

    def _vouchable(self) -> Loaded | None:
        health, loaded = self.health, self.loaded
        if health is None or loaded is None:
            return None
        if not health.healthy or health.torn or health.incarnation != loaded.incarnation:
            return None
        # An engine that names no incarnation (SGLang, vLLM) is the same process only as
        # far as it still says the version loaded: restarted, it answers its start-up
        # label ("default"), and vouching by incarnation alone (None == None) opened a
        # restarted vLLM's gate on dummy weights.
        if health.version != loaded.version:
            return None
        return loaded

    def readiness(self) -> tuple[bool, str]:
        """Whether the engine container is ready, and why: healthy at a recent poll and,
        once this agent has loaded it, serving what was loaded into this very process.
        Before the first load the engine is ready on its start-up weights (the pod's gate
        keeps it out of traffic: it must be ready to be planned into its first round)."""
        health = self.health
        if health is None:
            return False, "the engine has not answered its agent yet"
        age = time.monotonic() - self.checked_at
        if age > READY_STALE_SECONDS:
            return False, f"the engine's last answer to its agent is {age:.0f} s old"
        if not health.healthy:
            return False, f"the engine is not healthy: {health.detail or 'no detail'}"
        if health.torn:
            return False, "an aborted update left the engine inconsistent"
        if self._ever_loaded and self._vouchable() is None:
            return False, "restarted: behind until a round or a recovery loads it"
        return True, "healthy, serving what its agent loaded (or its start-up weights)"

    def status(self) -> EngineStatus:
        health = self.health
        if health is None or time.monotonic() - self.checked_at > STALE_SECONDS:
            detail = "no recent health" if health is not None else "not polled yet"
            return EngineStatus(healthy=False, version=None, detail=detail)
        vouched = self.vouched()
        detail = health.detail
        if self.loaded is not None and vouched is None and health.healthy and not health.torn:
            detail = "restarted: behind until a round or a recovery loads it"
        return EngineStatus(
            healthy=health.healthy,
            version=vouched.version if vouched else None,
            torn=health.torn,
            detail=detail,
            lineage=(vouched.lineage or None) if vouched else None,
            incarnation=health.incarnation,
            reported_version=health.version,
            loaded_unix=vouched.at if vouched else None,
        )
