"""Moving sharded pieces in and out of bucket buffers, on the device that holds them.

The owner of a segment packs its local pieces (each the contiguous local shard a
trainer rank holds) into the segment's bytes; every receiver of a staged segment then
copies each piece into its box of the full tensor inside the bucket slot. A box that
spans whole rows (a dim-0 shard) is one contiguous copy; any other box (a `Shard(1)`
weight, a block of a 2-D mesh) is a strided copy on the device. `transfer.shards`
decides where everything goes; nothing here plans. `SlotRoutes` says, for one rank's
slots, which bytes each broadcast of a bucket moves and where the staged pieces land:
every rank assembles full buckets in its slots (engines, holders and checksums read them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property

import torch

from weightsync.transfer.buffers import copy_tensors, torch_dtype
from weightsync.transfer.layout import Bucket
from weightsync.transfer.shards import Piece, Segment, ShardPlan


def piece_views(buffer: torch.Tensor, pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """Each piece's bytes in `buffer` (a uint8 slot or staging buffer), typed and shaped."""
    return [
        buffer[p.offset : p.offset + p.nbytes].view(torch_dtype(p.dtype)).view(p.box.shape)
        for p in pieces
    ]


def pack_segment(segment: Segment, local: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> None:
    """Copy the owner's local pieces of `segment` into `buffer` (the slot if the segment is
    direct, else the staging buffer), on the current stream."""
    views = piece_views(buffer, segment.pieces)
    copy_tensors(views, [local[p.name] for p in segment.pieces])


def placement_views(
    bucket: Bucket, segment: Segment, staging: torch.Tensor, slot: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(targets, sources): each piece of a staged segment's box in the bucket's tensor in
    the slot, and its bytes in staging."""
    if segment.direct:
        return [], []  # received in place
    where = {t.name: t for t in bucket.tensors}
    targets: list[torch.Tensor] = []
    for piece in segment.pieces:
        item = where[piece.name]
        full = slot[item.offset : item.offset + item.nbytes].view(torch_dtype(item.dtype))
        view = full.view(item.shape)
        for dim, (start, size) in enumerate(zip(piece.box.offset, piece.box.shape, strict=True)):
            view = view.narrow(dim, start, size)
        targets.append(view)
    return targets, piece_views(staging, segment.pieces)


def place_pieces(
    bucket: Bucket, segment: Segment, staging: torch.Tensor, slot: torch.Tensor
) -> None:
    """Copy a received staged segment's pieces into their boxes of the bucket's tensors."""
    targets, sources = placement_views(bucket, segment, staging, slot)
    if targets:
        copy_tensors(targets, sources)


class SlotRoutes:
    """One rank's view of a plan: its slots, with staging after the bucket's own bytes.

    The staging area starts at `plan.layout.capacity_bytes` in every slot, so a slot of
    `capacity_bytes + staging_bytes` serves any plan of the layout."""

    def __init__(self, plan: ShardPlan, slots: Sequence[torch.Tensor]) -> None:
        self.plan = plan
        self.slots = slots
        # Per (bucket, slot): every staged piece's target and source view, built once: a
        # model of 18,867 tensors spends ~0.6 s of Python per round building them.
        self._placements: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]]
        self._placements = {}
        self.staging_base = plan.layout.capacity_bytes
        need = self.staging_base + plan.staging_bytes
        if any(slot.numel() < need for slot in slots):
            raise ValueError(f"a slot holds fewer than the {need} bytes this plan needs")

    def _region(self, segment: Segment, slot: int) -> torch.Tensor:
        start = segment.offset + (0 if segment.direct else self.staging_base)
        return self.slots[slot][start : start + segment.nbytes]

    def sends(self, bucket: int, slot: int) -> list[tuple[int, torch.Tensor]]:
        """(owner rank, bytes) of each broadcast of `bucket`, in the order every rank
        issues them."""
        return [(s.owner, self._region(s, slot)) for s in self.plan.segments[bucket]]

    def fill_offsets(self, bucket: int, rank: int) -> list[tuple[str, int]]:
        """Where `rank` copies each of its pieces of `bucket`: (tensor name, slot offset)."""
        return [
            (piece.name, piece.offset + (0 if segment.direct else self.staging_base))
            for segment in self.plan.segments_of(rank, bucket)
            for piece in segment.pieces
        ]

    @cached_property
    def staged(self) -> bool:
        return any(not s.direct for segments in self.plan.segments for s in segments)

    def place(self, bucket: int, slot: int) -> None:
        """Copy `bucket`'s received staged pieces into their tensors in the slot."""
        if not self.staged:
            return
        views = self._placements.get((bucket, slot))
        if views is None:
            layout_bucket = self.plan.layout.buckets[bucket]
            buffer = self.slots[slot]
            staging = buffer[self.staging_base :]
            targets: list[torch.Tensor] = []
            sources: list[torch.Tensor] = []
            for segment in self.plan.segments[bucket]:
                more = placement_views(layout_bucket, segment, staging, buffer)
                targets += more[0]
                sources += more[1]
            views = self._placements[(bucket, slot)] = (targets, sources)
        if views[0]:
            copy_tensors(*views)
