"""A sharded rank's tensors, described once: the same DTensors again skip describing.

Describing a DTensor costs ~80 us (its local shape and offset through torch's helpers):
1.5 s a call for a 30B MoE's 18,867 tensors. A trainer publishes the same parameters
every step, so the description is kept while the DTensor objects and their shards'
addresses are unchanged. A world of one rank (gloo) is enough to build DTensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.support.ports import free_port
from weightsync.client.inputs import Described, checked_tensors, kept_of
from weightsync.client.shards import describe


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def described(tensors: dict[str, torch.Tensor]) -> Described:
    pieces = [describe(n, t) for n, t in tensors.items()]
    local = {p.meta.name: p.local for p in pieces if p.local is not None}
    boxes = [(list(p.box.offset), list(p.box.shape)) if p.box else None for p in pieces]
    return Described([p.meta for p in pieces], boxes, local, [(p.meta, p.box) for p in pieces])


def test_the_same_dtensors_again_keep_their_description(mesh: DeviceMesh) -> None:
    tensors = {
        "w": distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.randn(4), mesh, [Shard(0)]),
        "plain": torch.randn(3),  # whole on every rank, beside the shards
    }
    kept = kept_of(tensors, described(tensors))
    assert kept is not None
    assert kept.local == ["w", "b", "plain"]
    again, same = checked_tensors(tensors, kept.accepted)
    assert same
    reused = kept.described(again)
    assert reused.metas is kept.metas
    assert reused.boxes == kept.boxes
    w = tensors["w"]
    assert isinstance(w, DTensor)
    assert reused.local["w"].data_ptr() == w.to_local().data_ptr()
    w.to_local().add_(1.0)  # the optimizer's in-place step: still the same shard
    assert checked_tensors(tensors, kept.accepted)[1]


def test_a_new_shard_or_dtensor_is_described_again(mesh: DeviceMesh) -> None:
    tensors = {"w": distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])}
    kept = kept_of(tensors, described(tensors))
    assert kept is not None
    moved = {"w": distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])}  # a new object
    assert not checked_tensors(moved, kept.accepted)[1]
    w = tensors["w"]
    assert isinstance(w, DTensor)
    w._local_tensor = torch.randn(6, 4)  # the same DTensor over new storage
    assert not checked_tensors(tensors, kept.accepted)[1]


def test_a_shard_copied_to_be_contiguous_is_never_kept(mesh: DeviceMesh) -> None:
    """Describing copies a non-contiguous shard: keeping that copy would publish stale
    bytes the next time, so such a set is described on every call."""
    local = torch.randn(4, 6).t()  # (6, 4), not contiguous
    tensors = {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}
    assert kept_of(tensors, described(tensors)) is None
