"""A Colocated round with one copy: the source agent packs the Publisher's tensors
straight into the engine's staging memory.

Through slots, a Colocated round copies the model twice (the trainer's tensors into the
agent's slot, the slot into the engine's staging arena): 3.1x the one-GPU D2D floor on
an H200. Where the engine hands out its staging memory (`EngineAdapter.stages_directly`:
the reference engine, whose arenas the agent maps by CUDA IPC) and the agent maps the
Publisher's tensors (`SourcePacker`), each bucket is copied once:

* the engine opens the update and stages every bucket in one round trip
  (`begin_staged`), answering views of its arenas (a trip per bucket cost about a
  millisecond before the first copy);
* the agent queues every bucket's copies into them in one hop to its collective thread
  and records an interprocess CUDA event after them;
* it asks the engine to commit once that event completed (`finish_staged`): the engine
  commits complete bytes only, and the request travels while the copies end (waiting
  for them first cost another half millisecond). Without CUDA the agent waits for its
  copies, then asks (`finish_update`).

Nothing is received elsewhere, so there are no slots, no broadcast, no checksums and no
doorbell (its TCPStore write would hold the collective thread, and with it the first
pack, for about a millisecond).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

import torch

from weightsync.agent.packing import SourcePacker
from weightsync.agent.rounds import RoundFailed
from weightsync.agent.source import SourceRound
from weightsync.api.reasons import FailureReason

log = logging.getLogger(__name__)


class DirectStagingRound(SourceRound):
    def __init__(self, *args: Any, packer: SourcePacker, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packer = packer
        self._views: list[list[torch.Tensor]] = []  # each bucket's views in the arenas
        self._staging: asyncio.Task[None] | None = None
        self._queued = False  # copies into the engine's arenas may be on the GPU
        # Recorded after the copies: the engine commits once it completed, so the
        # finish request travels while the copies end (None: the agent waits first).
        engine = self.local_engine
        self._copies = engine.copies_event(self.slots.device) if engine is not None else None

    def _begin_local(self) -> None:
        """Open the engine's update and stage every bucket, on the lane."""
        engine, lane = self.local_engine, self.lane
        if engine is None or lane is None:
            return
        buckets = [b.tensors for b in self.layout.buckets]

        async def begin() -> None:
            self._views = await engine.begin_staged(self.version, buckets)

        self.begun = True
        self._staging = lane.submit("begin and stage", "engine_begin", begin)

    def _pack_all(self, kernel: bool) -> None:
        """Queue every bucket's copies on this (the collective) thread's stream."""
        for bucket, views in zip(self.layout.buckets, self._views, strict=True):
            self.packer.pack_into(bucket.index, views, kernel=kernel)
            self.trace.gpu_mark("packed")
        if self._copies is not None:
            self._copies.record(torch.cuda.current_stream(self.slots.device))

    def _packed(self) -> None:
        """Return once every copy queued on this (the collective) thread's stream is done."""
        if self.slots.device.type == "cuda":
            torch.cuda.current_stream(self.slots.device).synchronize()

    async def _stream(self) -> list[int]:
        lane, staging = self.lane, self._staging
        if lane is None or staging is None:
            raise RoundFailed(FailureReason.INTERNAL_ERROR, "a direct round needs its engine")
        await lane.wait(staging, "stage_wait")
        if self._round_error() is None:
            started = self.trace.now()
            beside = self.hold is not None and not self.hold.done()  # the holder's copy
            awaited = False  # by the engine, through the event
            try:
                self._queued = True
                self.trace.gpu_mark("first_issue")
                await self.group.run(partial(self._pack_all, beside))
                awaited = self._copies is not None
            finally:
                self.trace.add("pack", started)
                if not awaited:  # the engine must not commit under our copies
                    started = self.trace.now()
                    await self.group.run(self._packed)
                    self.trace.add("pack_drain", started)
        started = self.trace.now()
        await lane.drain()
        self.trace.add("engine_drain", started)
        self.trace.mark("streamed")
        return []

    async def _commit_local(self) -> None:
        engine, lane, copies = self.local_engine, self.lane, self._copies
        if engine is None or lane is None or copies is None:
            await super()._commit_local()
            return
        finish = partial(engine.finish_staged, self.version, copies)
        await lane.submit("finish", "engine_finish", finish)

    async def _abort_local(self, reason: str) -> None:
        if self._queued:  # nor free its arenas under them
            try:
                await self.group.run(self._packed)
            except Exception as exc:  # a failure path: the abort goes out regardless
                log.warning("waiting for the copies before the abort: %r", exc)
        await super()._abort_local(reason)
