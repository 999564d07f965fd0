"""Copying a trainer rank's tensors into the agent's bucket slots, bucket by bucket.

Used where the agent cannot map the tensors itself (CPU, or a sharded rank, which sends
only its pieces): the Publisher copies each bucket, or its own pieces of it, into the
slot the agent names, and the slot views are built once per (slot, bucket).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from weightsync.transfer.buffers import SlotHandles, copy_tensors, open_slots, slot_views
from weightsync.transfer.handoff import Fill
from weightsync.transfer.layout import BucketLayout


class SlotFiller:
    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        # Sharded: per (slot, bucket), the pieces the agent asked for and their slot views.
        self._piece_views: dict[tuple[int, int], tuple[list[tuple[str, int]], list[torch.Tensor]]]
        self._piece_views = {}
        self.packed: list[float] = []  # this publish's time per fill

    def open(self, handles: SlotHandles | None) -> None:
        """Map the agent's slots (None: the agent packs, no slots)."""
        self._slots = [] if handles is None else open_slots(handles)
        self._views.clear()
        self._piece_views.clear()

    @torch.no_grad()
    def fill(self, layout: BucketLayout, tensors: dict[str, torch.Tensor], fill: Fill) -> None:
        started = time.perf_counter()
        if fill.slots is not None:  # the agent grew its slots for this round's layout
            self.open(fill.slots)
        slot = self._slots[fill.slot]
        if fill.pieces is not None:  # sharded: this rank's blocks, where the agent says
            names = [name for name, _ in fill.pieces]
            key = (fill.slot, fill.bucket)
            known = self._piece_views.get(key)
            if known is None or known[0] != fill.pieces:  # built once: the same every round
                views = [
                    slot[offset : offset + tensors[name].nbytes]
                    .view(tensors[name].dtype)
                    .view(tensors[name].shape)
                    for name, offset in fill.pieces
                ]
                self._piece_views[key] = (fill.pieces, views)
            else:
                views = known[1]
        else:
            bucket = layout.buckets[fill.bucket]
            names = [t.name for t in bucket.tensors]
            key = (fill.slot, fill.bucket)
            if key not in self._views:
                self._views[key] = slot_views(slot, bucket.tensors)
            views = self._views[key]
        # On the current stream, after whatever the trainer queued that writes the tensors.
        copy_tensors(views, [tensors[name] for name in names])
        if slot.is_cuda:  # the agent broadcasts from another process: the copy must be done
            torch.cuda.current_stream(slot.device).synchronize()
        self.packed.append(time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class PublishTimings:
    """Where the last `publish()` spent its time in the trainer's process, in seconds."""

    total: float
    pack: float  # copying buckets into the agent's slots, each until its copy completed
    longest_pack: float
    buckets: int
    # Until the Publish message went out: input checks and the tensor set's description
    # (Python work per tensor), then `sync`, waiting for the trainer's queued GPU work.
    prepare: float = 0.0
    sync: float = 0.0
    fence: float = 0.0  # waiting for the agent's holder copy of the last round (`fence`)

    @property
    def waiting(self) -> float:
        """Time spent waiting on the agent (broadcast, engines, votes) rather than packing."""
        return self.total - self.pack
