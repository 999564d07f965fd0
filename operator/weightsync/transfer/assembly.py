"""Moving sharded pieces in and out of bucket buffers, on the device that holds them.

The owner of a segment packs its local pieces (each the contiguous local shard a
trainer rank holds) into the segment's bytes; every receiver of a staged segment then
copies each piece into its box of the full tensor inside the bucket slot. A box that
spans whole rows (a dim-0 shard) is one contiguous copy; any other box (a `Shard(1)`
weight, a block of a 2-D mesh) is a strided copy on the device. `transfer.shards`
decides where everything goes; nothing here plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightsync.transfer.buffers import copy_tensors, torch_dtype
from weightsync.transfer.layout import Bucket
from weightsync.transfer.shards import Piece, Segment


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


def place_pieces(
    bucket: Bucket, segment: Segment, staging: torch.Tensor, slot: torch.Tensor
) -> None:
    """Copy a received staged segment's pieces into their boxes of the bucket's tensors."""
    if segment.direct:
        return  # received in place
    where = {t.name: t for t in bucket.tensors}
    sources = piece_views(staging, segment.pieces)
    targets: list[torch.Tensor] = []
    for piece in segment.pieces:
        item = where[piece.name]
        full = slot[item.offset : item.offset + item.nbytes].view(torch_dtype(item.dtype))
        view = full.view(item.shape)
        for dim, (start, size) in enumerate(zip(piece.box.offset, piece.box.shape, strict=True)):
            view = view.narrow(dim, start, size)
        targets.append(view)
    copy_tensors(targets, sources)
