"""`shards.local_box` against `torch.chunk`, the split DTensor's `Shard` makes, over every
coordinate of 1-d and 2-d meshes (uneven, empty and nested shards included)."""

from __future__ import annotations

import itertools
from typing import Any, cast

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from weightsync.client.shards import local_box


class Mesh:
    """What `local_box` reads of a DeviceMesh: its sizes and this rank's coordinate."""

    def __init__(self, sizes: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        self.sizes, self.coordinate = sizes, coordinate

    def size(self, dim: int) -> int:
        return self.sizes[dim]

    def get_coordinate(self) -> list[int]:
        return list(self.coordinate)


def chunked(shape: tuple[int, ...], sizes: tuple[int, ...], coordinate: tuple[int, ...],
            placements: list[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """The box, by chunking an index tensor per dimension the way Shard does."""
    index = [torch.arange(n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dim = placement.dim % len(shape)
            chunks = index[dim].chunk(sizes[mesh_dim])
            r = coordinate[mesh_dim]
            index[dim] = chunks[r] if r < len(chunks) else index[dim][:0]
    starts = [int(i[0]) if len(i) else None for i in index]
    return tuple(len(i) for i in index), tuple(s if s is not None else -1 for s in starts)


CASES = [
    ((33, 8), (4,), [Shard(0)]),
    ((2, 3), (4,), [Shard(0)]),  # two ranks hold nothing
    ((5, 7), (3,), [Shard(-1)]),
    ((10, 13), (2, 2), [Shard(0), Shard(1)]),
    ((7, 3), (2, 2), [Shard(0), Shard(0)]),  # nested on one dimension
    ((9, 4), (2, 3), [Replicate(), Shard(0)]),
    ((6,), (4,), [Replicate()]),
]


@pytest.mark.parametrize(("shape", "sizes", "placements"), CASES)
def test_every_coordinate_gets_the_chunk_torch_gives_it(
    shape: tuple[int, ...], sizes: tuple[int, ...], placements: list[Any]
) -> None:
    for coordinate in itertools.product(*(range(s) for s in sizes)):
        mesh = cast(Any, Mesh(sizes, coordinate))
        got_shape, got_offset = local_box(shape, mesh, placements)
        want_shape, want_offset = chunked(shape, sizes, coordinate, placements)
        assert got_shape == want_shape, (coordinate, got_shape, want_shape)
        for dim, start in enumerate(want_offset):
            if start >= 0:  # an empty block's offset is not the bytes of anything
                assert got_offset[dim] == start, (coordinate, got_offset, want_offset)


def test_a_rank_outside_the_mesh_holds_nothing() -> None:
    class Outside(Mesh):
        def get_coordinate(self) -> list[int]:
            return cast(list[int], None)

    mesh = cast(Any, Outside((2,), (0,)))
    assert local_box((4, 4), mesh, [Shard(0)]) == ((0, 0), (0, 0))
