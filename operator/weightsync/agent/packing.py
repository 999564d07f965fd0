"""Packing buckets in the source agent, from the Publisher's tensors mapped by CUDA IPC:
whole buckets (`SourcePacker`) or a sharded rank's pieces of them (`PiecePacker`).

Two processes' kernels on one GPU are time-sliced, not overlapped: a Publisher packing
bucket k+1 in the trainer's process while the agent's NCCL kernel broadcasts bucket k
stretches both (measured: 1.27 ms per 512 MiB bucket instead of 0.25 ms, the wire
27 ms slower per round). Packed here, the copies are queued on the stream the broadcast
is issued from, in the same process, so the GPU orders them before the broadcast with
no host round trip, and runs them beside the previous bucket's broadcast.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import torch

from weightsync.agent.rounds import RoundFailed
from weightsync.api.reasons import FailureReason
from weightsync.transfer.buffers import (
    SlotError,
    SlotHandles,
    TensorSources,
    copy_tensors,
    open_sources,
    slot_views,
)
from weightsync.transfer.handoff import Boxes, Pieces
from weightsync.transfer.layout import BucketLayout, TensorMeta

log = logging.getLogger(__name__)

Run = Callable[[Callable[[], Any]], Awaitable[Any]]


class SourcePacker:
    """The Publisher's tensors (views of its storages, mapped once per attach), by name."""

    def __init__(self, layout: BucketLayout, tensors: Sequence[torch.Tensor]) -> None:
        self.layout = layout
        self.by_name = {meta.name: t for meta, t in zip(layout.tensors, tensors, strict=True)}
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}

    def channel(self, slots: Sequence[torch.Tensor], run: Run) -> PackingChannel:
        """A `FillChannel` for one round; `run` runs a call on the collective thread."""
        return PackingChannel(self, slots, run)

    def pack(self, bucket: int, slot: int, slots: Sequence[torch.Tensor]) -> None:
        """Queue bucket `bucket`'s copies into slot `slot` on the current stream.

        One multi-tensor kernel rather than a memcpy per tensor: beside the holder's
        device-to-host copy (which keeps the copy engines busy for the whole round),
        memcpys measured 66 / 94 ms rounds (512 MiB / 1 GiB buckets, 4x H200, 8B) and
        the kernel 61 / 62 ms; without a holder the two are equal within noise.
        """
        views = self._views.get((slot, bucket))
        if views is None:
            tensors = self.layout.buckets[bucket].tensors
            views = self._views[(slot, bucket)] = slot_views(slots[slot], tensors)
        torch._foreach_copy_(views, self.sources(bucket))

    def sources(self, bucket: int) -> list[torch.Tensor]:
        """Bucket `bucket`'s tensors as published, in layout order."""
        return [self.by_name[t.name] for t in self.layout.buckets[bucket].tensors]

    def pack_into(self, bucket: int, destinations: list[torch.Tensor], *, kernel: bool) -> None:
        """Queue bucket `bucket`'s copies into `destinations` (the engine's own staging
        memory, `EngineAdapter.begin_staged`) on the current stream. Alone, large tensors
        one `copy_` each: the one-GPU D2D floor (one multi-tensor kernel for a whole 8B
        model measured 1.34x it on an H200). With `kernel` (the holder's device-to-host
        copy runs beside, keeping the copy engines busy), one multi-tensor kernel, as in
        `pack`, so the pack does not queue behind it."""
        if kernel:
            torch._foreach_copy_(destinations, self.sources(bucket))
        else:
            copy_tensors(destinations, self.sources(bucket))


class PackingChannel:
    """Fills a slot by packing it here. The copies are queued on the collective thread's
    current stream, which the broadcast of the slot (issued next, on the same thread)
    waits on; the caller reuses a slot only after its broadcast completed."""

    def __init__(self, packer: SourcePacker, slots: Sequence[torch.Tensor], run: Run) -> None:
        self._packer = packer
        self._slots = slots
        self._run = run

    async def fill(
        self,
        bucket: int,
        slot: int,
        pieces: Pieces | None = None,
        slots: SlotHandles | None = None,
    ) -> None:
        if pieces is not None or slots is not None:
            raise RoundFailed(
                FailureReason.PUBLISHER_PROTOCOL, "pieces are a sharded round's: PieceChannel"
            )
        await self._run(partial(self._packer.pack, bucket, slot, self._slots))


def held_blocks(
    metas: Sequence[TensorMeta], boxes: Boxes | None
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, local shape, dtype) of each block a rank holds, in `Attach` order: every
    tensor whole without boxes, else the tensors whose box is not None, at its shape."""
    if boxes is None:
        return [(m.name, tuple(m.shape), m.dtype) for m in metas]
    return [
        (m.name, tuple(box[1]), m.dtype)
        for m, box in zip(metas, boxes, strict=True)
        if box is not None
    ]


class PiecePacker:
    """A sharded rank's blocks (its DTensors' local shards, its whole plain tensors),
    mapped once per attach. The round's plan says where each piece of a bucket goes in
    the slot; the agent copies it there on the collective thread's stream, as
    `SourcePacker` does for whole buckets, instead of asking the Publisher to: a pack in
    the trainer's process is a round trip per bucket and time-slices with the broadcast."""

    def __init__(self, by_name: dict[str, torch.Tensor]) -> None:
        self.by_name = by_name
        # Per (slot, bucket): the pieces, their slot views and their sources.
        self._views: dict[tuple[int, int], tuple[Pieces, list[torch.Tensor], list[torch.Tensor]]]
        self._views = {}
        self._slots: Sequence[torch.Tensor] = ()

    def forget(self) -> None:
        """Drop the slot views (before the slots are reallocated: they hold the old ones)."""
        self._views.clear()
        self._slots = ()

    def channel(self, slots: Sequence[torch.Tensor], run: Run) -> PieceChannel:
        if slots is not self._slots:
            self.forget()
            self._slots = slots
        return PieceChannel(self, run)

    def pack(self, bucket: int, slot: int, pieces: Pieces) -> None:
        """Queue this rank's pieces of `bucket` into slot `slot` on the current stream."""
        known = self._views.get((slot, bucket))
        if known is None or known[0] != pieces:  # the same every round of a plan
            target = self._slots[slot]
            try:
                sources = [self.by_name[name] for name, _ in pieces]
            except KeyError as exc:
                raise RoundFailed(
                    FailureReason.PUBLISHER_PROTOCOL,
                    f"the plan names {exc} but this rank does not hold it",
                ) from None
            views = [
                target[offset : offset + src.nbytes].view(src.dtype).view(src.shape)
                for (_, offset), src in zip(pieces, sources, strict=True)
            ]
            known = self._views[(slot, bucket)] = (pieces, views, sources)
        torch._foreach_copy_(known[1], known[2])


class PieceChannel:
    """Fills a slot with this rank's pieces, packed here (see `PiecePacker`). Slot handles
    a resized round offers are the agent's own: nothing to map."""

    def __init__(self, packer: PiecePacker, run: Run) -> None:
        self._packer = packer
        self._run = run

    async def fill(
        self,
        bucket: int,
        slot: int,
        pieces: Pieces | None = None,
        slots: SlotHandles | None = None,
    ) -> None:
        del slots
        if pieces is None:
            raise RoundFailed(FailureReason.PUBLISHER_PROTOCOL, "a sharded round packs pieces")
        await self._run(partial(self._packer.pack, bucket, slot, pieces))


def map_packer(
    layout: BucketLayout,
    blocks: list[tuple[str, tuple[int, ...], str]],
    sources: TensorSources,
    device: torch.device,
    sharded: bool,
) -> SourcePacker | PiecePacker | None:
    """The Publisher's tensors (`blocks`, in `Attach` order) mapped here, as the packer of
    whole buckets or, `sharded`, of a rank's pieces; None where they cannot be mapped
    onto `device` (the Publisher then packs, one Fill per bucket)."""
    try:
        tensors = open_sources(sources, blocks) if blocks else []
    except (SlotError, RuntimeError, SystemError) as exc:  # torch's IPC open: SystemError
        log.warning("cannot map the Publisher's tensors, it packs them itself: %s", exc)
        return None
    if not tensors or any(t.device != device for t in tensors):
        log.warning("the Publisher's tensors are not on %s: it packs them itself", device)
        return None
    if sharded:
        return PiecePacker({name: t for (name, _, _), t in zip(blocks, tensors, strict=True)})
    return SourcePacker(layout, tensors)
