"""A Colocated round with one copy: the source agent packs the Publisher's tensors
straight into the engine's staging memory.

Through slots, a Colocated round copies the model twice (the trainer's tensors into the
agent's slot, the slot into the engine's staging arena): 3.1x the one-GPU D2D floor on
an H200. Where the engine hands out its staging memory (`EngineAdapter.stages_directly`:
the reference engine, whose arenas the agent maps by CUDA IPC) and the agent maps the
Publisher's tensors (`SourcePacker`), each bucket is copied once: the engine stages
bucket k on the lane, ahead of the packing, and answers views of its arena; the agent
queues the copies into them on its stream and, before `finish_update`, waits for that
stream, so the engine commits complete bytes only. Nothing is received elsewhere, so
there are no slots, no broadcast, no checksums and no doorbell (its TCPStore write
would hold the collective thread, and with it the first pack, for about a millisecond).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from weightsync.agent.packing import SourcePacker
from weightsync.agent.rounds import RoundFailed
from weightsync.agent.source import SourceRound
from weightsync.api.reasons import FailureReason
from weightsync.transfer.layout import Bucket


class DirectStagingRound(SourceRound):
    def __init__(self, *args: Any, packer: SourcePacker, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packer = packer
        self._views: dict[int, list[torch.Tensor]] = {}  # bucket -> its views in the arena

    async def _stage(self, bucket: Bucket) -> None:
        if self.local_engine is not None:
            self._views[bucket.index] = await self.local_engine.stage_views(bucket.tensors)

    def _packed(self) -> None:
        """Return once every copy queued on this (the collective) thread's stream is done."""
        if self.slots.device.type == "cuda":
            torch.cuda.current_stream(self.slots.device).synchronize()

    async def _stream(self) -> list[int]:
        lane = self.lane
        if lane is None or self.local_engine is None:
            raise RoundFailed(FailureReason.INTERNAL_ERROR, "a direct round needs its engine")
        stages = [
            lane.submit(f"stage bucket {b.index}", "engine_stage", partial(self._stage, b))
            for b in self.layout.buckets
        ]
        queued = False
        try:
            for bucket, stage in zip(self.layout.buckets, stages, strict=True):
                await lane.wait(stage, "stage_wait")
                if self._round_error() is not None:
                    break
                started = self.trace.now()
                views = self._views.pop(bucket.index)
                beside = self.hold is not None and not self.hold.done()  # the holder's copy
                pack = partial(self.packer.pack_into, bucket.index, views, kernel=beside)
                await self.group.run(pack)
                queued = True
                self.trace.add("fill", started)
                if bucket.index == 0:
                    self.trace.gpu_mark("first_issue")
        finally:
            if queued:  # the engine must not commit, nor free its arena, under our copies
                started = self.trace.now()
                await self.group.run(self._packed)
                self.trace.add("pack_drain", started)
        started = self.trace.now()
        await lane.drain()
        self.trace.add("engine_drain", started)
        self.trace.mark("streamed")
        return []
