"""What one trainer rank holds of each tensor it publishes.

A plain tensor is held whole. A `DTensor` (FSDP2's `fully_shard`, tensor parallel
placements over a `DeviceMesh`, expert-parallel layouts built from them) is described by
its global shape and dtype and the box of it this rank's local tensor is: `Shard(d)`
along any dimension, uneven shards, several mesh dimensions, and `Replicate` (the
lowest rank holding a replica sends it; `transfer.shards` decides). A rank whose shard is
empty holds nothing of that tensor, and says so.

The box is computed here from public DTensor API (placements, the mesh's sizes and this
rank's coordinate) with the rule `Shard` splits by (`torch.chunk`'s: ceil-sized chunks,
the last ones short or empty), not from torch's private helpers, whose behaviour has
changed between releases; `tests/engines_real/test_client_torch.py` checks it on every
torch the client claims.

Refused, naming the tensor and the rule: `Partial` placements (a pending reduction: the
engine would get one rank's addend) and strided shards (FSDP2 over tensor parallelism on
the same dimension interleaves rows: no single box describes them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

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


def local_box(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: Iterable[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and global offset of this rank's block of a tensor of global `shape`
    placed on `mesh` (plain `Shard` and `Replicate` only): each `Shard(d)` splits what the
    mesh dimensions before it left of dimension `d` into `mesh.size(i)` chunks of
    ceil(n / size) elements, the chunk of this rank's coordinate its own."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: holds nothing
        return (0,) * len(shape), (0,) * len(shape)
    sizes, offsets = list(shape), [0] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim % len(shape)
        chunk = -(-sizes[dim] // mesh.size(mesh_dim))
        start = min(chunk * coordinate[mesh_dim], sizes[dim])
        offsets[dim] += start
        sizes[dim] = min(chunk, sizes[dim] - start)
    return tuple(sizes), tuple(offsets)


def describe(name: str, tensor: torch.Tensor) -> LocalPiece:
    """`tensor` (plain or DTensor) as global metadata, this rank's box and local bytes."""
    if not isinstance(tensor, DTensor):
        meta = TensorMeta(name, tuple(tensor.shape), dtype_name(tensor.dtype))
        return LocalPiece(meta, Box.whole(tensor.shape), tensor)
    check_placements(name, tensor)
    shape, offset = local_box(tuple(tensor.shape), tensor.device_mesh, tensor.placements)
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
