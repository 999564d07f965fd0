"""What one trainer rank holds of each tensor it publishes.

A plain tensor is held whole. A `DTensor` (FSDP2's `fully_shard`, tensor parallel
placements over a `DeviceMesh`, expert-parallel layouts built from them) is described by
its global shape and dtype and the box of it this rank's local tensor is: `Shard(d)`
along any dimension, uneven shards, several mesh dimensions, and `Replicate` (the
lowest rank holding a replica sends it; `transfer.shards` decides). A rank whose shard is
empty holds nothing of that tensor, and says so.

Refused, naming the tensor and the rule: `Partial` placements (a pending reduction: the
engine would get one rank's addend) and strided shards (FSDP2 over tensor parallelism on
the same dimension interleaves rows: no single box describes them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from weightsync.transfer.buffers import dtype_name
from weightsync.transfer.layout import TensorMeta
from weightsync.transfer.shards import Box


class ShardError(ValueError):
    """A tensor whose placement this rank cannot describe as one box."""


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """One tensor as this rank publishes it."""

    meta: TensorMeta  # the global tensor: name, shape, dtype
    box: Box | None  # what this rank holds of it; None: nothing
    local: torch.Tensor | None  # the bytes of `box`, contiguous in the box's shape


def is_sharded(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of `tensors` is a DTensor (then every tensor is described by its box)."""
    return any(isinstance(t, DTensor) for t in tensors)


def check_placements(name: str, tensor: DTensor) -> None:
    """Raise `ShardError` unless every placement of `tensor` is a plain Shard or Replicate."""
    for placement in tensor.placements:
        if isinstance(placement, Partial):
            raise ShardError(
                f"tensor {name!r}: a Partial placement is a pending reduction; redistribute "
                "it to Replicate or Shard before publishing"
            )
        if type(placement) not in (Shard, Replicate):  # _StridedShard subclasses Shard
            raise ShardError(
                f"tensor {name!r}: placement {placement} is not a plain Shard or Replicate "
                "(strided shards interleave rows: publish full_tensor() or redistribute)"
            )


def describe(name: str, tensor: torch.Tensor) -> LocalPiece:
    """`tensor` (plain or DTensor) as global metadata, this rank's box and local bytes."""
    if not isinstance(tensor, DTensor):
        meta = TensorMeta(name, tuple(tensor.shape), dtype_name(tensor.dtype))
        return LocalPiece(meta, Box.whole(tensor.shape), tensor)
    check_placements(name, tensor)
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ShardError(
            f"tensor {name!r}: the local shard is {tuple(local.shape)}, its placements say "
            f"{tuple(shape)} (padded shards are not supported)"
        )
    meta = TensorMeta(name, tuple(tensor.shape), dtype_name(tensor.dtype))
    box = Box(tuple(offset), tuple(shape))
    if box.numel == 0:
        return LocalPiece(meta, None, None)
    return LocalPiece(meta, box, local if local.is_contiguous() else local.contiguous())
