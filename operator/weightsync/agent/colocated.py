"""The Colocated engine a source agent loads: its adapter, the slot epoch it attached, and
the memory it released while the trainer trained.

With several source ranks (every rank of the trainer pod, the engine tensor parallel over
the same GPUs) the lead, rank 0, drives the engine alone: the ranks assemble each bucket
in the lead's slots (`ShardedSourceRound`), the lead copies it to a slot on each other
rank's GPU and the engine's worker i reads the copy on its own GPU.

`Publisher.release()` frees what the plan's `memory_release` names; the next round wakes
the weights before any bucket moves and the KV cache once the round is over, so the GPU
never holds the engine's KV cache beside a model still arriving, nor two models. An
engine that cannot be released or woken fails the call or the round with its reason; it
is never left serving what it held before without saying so (engines refuse inference
while their weights are released, until a round commits new ones).

What is released is the engine's state, not the agent's: an agent that attaches to an
engine (at its start, or when the plan names a new engine pod) asks the engine what it
has released (`EngineAdapter.released_memory`) and adopts that, so an agent restarted
while its engine sleeps still wakes it, in order, in the next round. An engine that does
not say (SGLang) or cannot be asked then counts as awake, as before.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from weightsync.agent.engine_adapter import adapter_for
from weightsync.agent.rounds import RoundFailed
from weightsync.agent.slot_pool import slot_devices
from weightsync.api.control import LocalEngine, MembershipPlan
from weightsync.api.engines import MemoryTag, released_tags
from weightsync.api.reasons import FailureReason
from weightsync.engines.base import EngineAdapter, EngineError

log = logging.getLogger(__name__)


def lead_engine(plan: MembershipPlan) -> LocalEngine | None:
    """The Colocated engine this rank drives: the lead's (rank 0) alone. With several
    source ranks the others only send their pieces; the lead loads the engine."""
    return plan.local_engine if plan.rank == 0 else None


def engine_devices(device: torch.device, sources: int) -> list[torch.device]:
    """Where a Colocated lead keeps copies of its slots: its own device, then one per
    other source rank's GPU (local rank i on cuda:i; the engine's worker i reads the copy
    on its GPU). On CPU the copies are distinct shared-memory slots, one per worker."""
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    return slot_devices(str(device), sources, visible)


class ColocatedEngine:
    def __init__(self, timeout_seconds: float) -> None:
        self._timeout = timeout_seconds
        self._planned: tuple[LocalEngine, EngineAdapter] | None = None
        self.epoch = -1  # the slots' `engine_epoch` the engine attached
        self.asleep: frozenset[MemoryTag] = frozenset()  # released, not woken yet

    async def adapter(self, planned: LocalEngine) -> EngineAdapter:
        """The planned engine's adapter; a new planned engine (the agent's first, or its pod
        was replaced) attaches anew, asleep as far as the engine says."""
        if self._planned is not None:
            known, adapter = self._planned
            if known == planned:
                return adapter
            await adapter.close()
            if (known.pod, known.url) != (planned.pod, planned.url):
                self.asleep = frozenset()
        log.info("colocated engine: %s of pod %s at %s", planned.engine, planned.pod, planned.url)
        adapter = adapter_for(planned.engine, planned.url, planned.options)
        self._planned = (planned, adapter)
        self.epoch = -1
        await self._learn(adapter, planned.pod)
        return adapter

    async def _learn(self, adapter: EngineAdapter, pod: str) -> None:
        """Adopt what the engine says it has released (`asleep` stays as it was where the
        engine does not say or cannot be asked: a round then fails on its own)."""
        try:
            said = await asyncio.wait_for(adapter.released_memory(), self._timeout)
        except (EngineError, TimeoutError) as exc:
            log.warning("could not ask the engine of %s what it released: %r", pod, exc)
            return
        if said is None:
            return
        if said:
            log.info("colocated engine of %s is asleep: %s released", pod, ", ".join(sorted(said)))
        self.asleep = said

    async def release(self, planned: LocalEngine | None) -> frozenset[MemoryTag]:
        """Free what `planned.memory_release` names; what the engine freed."""
        tags = released_tags(planned.memory_release) if planned is not None else frozenset()
        if planned is None or not tags:
            return self.asleep
        adapter = await self.adapter(planned)
        if not tags - self.asleep:
            return self.asleep
        try:
            freed = await asyncio.wait_for(adapter.release_memory(tags), self._timeout)
        except (EngineError, TimeoutError) as exc:
            raise RoundFailed(
                FailureReason.ENGINE_RELEASE_FAILED,
                f"engine of {planned.pod} did not release {', '.join(sorted(tags))}: {exc!r}",
            ) from exc
        self.asleep |= freed
        log.info("colocated engine of %s released %s", planned.pod, ", ".join(sorted(freed)))
        return self.asleep

    async def wake(self, tag: MemoryTag) -> None:
        """Bring `tag` back if it was released; `RoundFailed` when the engine will not."""
        if tag not in self.asleep or self._planned is None:
            return
        pod, adapter = self._planned[0].pod, self._planned[1]
        try:
            await asyncio.wait_for(adapter.resume_memory(frozenset({tag})), self._timeout)
        except (EngineError, TimeoutError) as exc:
            raise RoundFailed(
                FailureReason.ENGINE_WAKE_FAILED, f"engine of {pod} did not wake {tag}: {exc!r}"
            ) from exc
        self.asleep -= {tag}

    async def close(self) -> None:
        if self._planned is not None:
            await self._planned[1].close()
