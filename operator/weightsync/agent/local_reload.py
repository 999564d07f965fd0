"""The Colocated engine reloaded from the held copy, without a round.

A Colocated engine restarted in place, or replaced (a new pod the plan names), comes back
on its start-up weights, and a failed round can leave it half-updated. The trainer's
agent (this one, the source) holds the last committed version in host memory (rank 0
holds in a Colocated group with recovery on: `plan.holder_ranks`), so it loads that
version again itself: no broadcast, no trainer step, and still one writer to the engine
(the engine pod's agent only watches it). Every `POLL_SECONDS`, between rounds:

* the newest plan names a local engine, this agent committed a version, and the holder
  holds exactly that version and lineage (on a GPU the held copy is kept at the
  Publisher's fence: `Publisher.release()`, `fence()` or its next publish);
* the engine is awake (nothing released), answers healthy and does not serve that
  version (`needs_reload`).

Then, under the rounds' lock: the slots attached, `begin_update`, each bucket copied from
the held copy into a slot and loaded, `finish_update`. The engine pod's agent sees the
version appear and vouches for it (`EngineWatch`); the operator opens the pod's gate. A
reload that fails aborts the update (the engine then says it is torn, never serving mixed
bytes without saying so), counts as a failed recovery in the metrics, and is retried
after a back-off; the next round brings the version anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from weightsync.agent.colocated import lead_engine
from weightsync.agent.metrics import AgentMetrics
from weightsync.api.reasons import RecoveryFailureReason
from weightsync.engines.base import EngineAdapter, EngineError, EngineHealth
from weightsync.transfer.broadcast import TransferError

if TYPE_CHECKING:
    from weightsync.agent.source_loop import SourceLoop

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
# How long an engine must be seen needing a reload first: the engine pod's agent vouches
# only for a version it saw the process load (`EngineWatch._observe_peer`), so it must
# have polled the restarted process (every second) before the reload.
SETTLE_SECONDS = 2.0
HEALTH_TIMEOUT_SECONDS = 2.0  # the lock is held meanwhile: a round may be waiting
BACKOFF_SECONDS = (2.0, 60.0)  # after a failed reload: doubling from the first, up to the last


def needs_reload(health: EngineHealth, version: int, attached: str | None) -> bool:
    """Whether a healthy engine must be loaded again with `version`: it serves another
    (or none), it is torn, or it is another process than the one the slots were attached
    to (`attached`: the incarnation the engine named then; engines that name none are
    judged by the version they report, their start-up label after a restart)."""
    if not health.healthy:
        return False  # nothing could load it; its agent reports it
    if health.torn or health.version != version:
        return True
    return health.incarnation is not None and health.incarnation != attached


class LocalReload:
    def __init__(self, loop: SourceLoop, metrics: AgentMetrics) -> None:
        self._loop = loop
        self._metrics = metrics
        self._failures = 0
        self._retry_at = 0.0
        self._needed_since: float | None = None  # when the engine was first seen needing it

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            if time.monotonic() >= self._retry_at:
                await self.check()

    async def check(self) -> bool:
        """Reload the Colocated engine if it needs it; whether it was reloaded."""
        loop = self._loop
        if not self._ready() or loop.book.round_in_progress:
            self._needed_since = None
            return False
        # Under the rounds' lock from here: the engine's adapter is the rounds' too (a
        # newly planned engine gets its adapter here or in a round, never in both).
        async with loop.exclusive():
            plan = loop.generations.newest_plan()
            version = loop.book.committed()[0]
            planned = lead_engine(plan) if plan is not None else None
            if not self._ready() or planned is None or version is None:
                return False
            engine = await loop.colocated.adapter(planned)
            try:
                health = await asyncio.wait_for(engine.health(), HEALTH_TIMEOUT_SECONDS)
            except (EngineError, TimeoutError):
                return False
            if not needs_reload(health, version, engine.attached_to):
                self._needed_since = None
                return False
            now = time.monotonic()
            if self._needed_since is None:
                self._needed_since = now
            if now - self._needed_since < SETTLE_SECONDS:
                return False
            return await self._reload(engine, planned.pod, health)

    def _ready(self) -> bool:
        """A local engine is planned and awake, and the held copy is what was committed."""
        loop = self._loop
        plan = loop.generations.newest_plan()
        version, lineage = loop.book.committed()
        held = loop.holder.held
        return (
            plan is not None
            and lead_engine(plan) is not None
            and version is not None
            and held is not None
            and (held.version, held.lineage) == (version, lineage)
            and not loop.colocated.asleep
        )

    async def _reload(self, engine: EngineAdapter, pod: str, health: EngineHealth) -> bool:
        loop, held = self._loop, self._loop.holder.held
        slots = loop.pool.slots
        if held is None or slots is None or slots.capacity < held.layout.capacity_bytes:
            return False  # the slots were sized for another tensor set
        started = time.monotonic()
        log.info(
            "reloading the colocated engine of %s with version %d from the held copy (%s)",
            pod, held.version, health.detail or f"it serves {health.version}",
        )  # fmt: skip
        timeout = loop.engine_timeout
        try:
            await asyncio.wait_for(loop.attach_engine(engine), timeout)
            await asyncio.wait_for(engine.begin_update(held.version), timeout)
            try:
                for bucket in held.layout.buckets:
                    index = bucket.index % len(slots.slots)
                    start = held.offsets[bucket.index]
                    source = held.buffer[start : start + bucket.nbytes]
                    target = slots.slots[index][: bucket.nbytes]
                    await asyncio.to_thread(target.copy_, source)
                    await loop.pool.replicate(index, bucket.nbytes).wait()  # engine devices
                    await asyncio.wait_for(engine.load_bucket(index, bucket.tensors), timeout)
                await asyncio.wait_for(engine.finish_update(held.version), timeout)
            except BaseException:
                await self._abort(engine, held.version)
                raise
        except (EngineError, TimeoutError, TransferError) as exc:
            self._failures += 1
            first, most = BACKOFF_SECONDS
            self._retry_at = time.monotonic() + min(first * 2 ** (self._failures - 1), most)
            if isinstance(exc, EngineError):
                self._metrics.recovery_failed(f"engine_{exc.reason}")
            elif isinstance(exc, TransferError):
                self._metrics.recovery_failed(RecoveryFailureReason.REPLICA_FAILED)
            else:
                self._metrics.recovery_failed(RecoveryFailureReason.ENGINE_TIMEOUT)
            log.warning("reloading the colocated engine of %s failed: %r", pod, exc)
            return False
        seconds = time.monotonic() - started
        self._failures, self._retry_at, self._needed_since = 0, 0.0, None
        self._metrics.recovery_succeeded(seconds, held.layout.total_bytes, held.version)
        log.info("reloaded the colocated engine of %s: version %d in %.3f s", pod, held.version,
                 seconds)  # fmt: skip
        return True

    async def _abort(self, engine: EngineAdapter, version: int) -> None:
        try:
            await asyncio.wait_for(engine.abort_update(version, "reload failed"), 5.0)
        except (EngineError, TimeoutError) as exc:
            log.warning("abort after a failed reload failed: %r", exc)
