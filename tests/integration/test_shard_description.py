"""Trainer ranks describe their DTensors; the plan from all of them rebuilds every tensor.

Four real processes (gloo, CPU) hold FSDP2-style dim-0 shards (uneven), tensor-parallel
`Shard(1)` blocks on a 2x2 mesh, replicas and expert-owned tensors; each rank describes
what it holds (`client.shards.describe`); `transfer.shards.plan_shards` plans from every
rank's report; packing each owner's segments and placing them rebuilds tensors that equal
`DTensor.full_tensor()` bit for bit.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.cluster.controlplane import free_port
from weightsync.transfer.assembly import pack_segment, place_pieces
from weightsync.transfer.shards import RankReport, plan_shards

WORLD = 4


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from weightsync.client.shards import ShardError, describe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        flat = init_device_mesh("cpu", (WORLD,))
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        gen = torch.Generator().manual_seed(11)
        full = {
            "embed": torch.randn(33, 8, generator=gen),  # 33 rows over 4: 9, 9, 9, 6
            "q": torch.randn(10, 12, generator=gen),
            "norm": torch.randn(12, generator=gen),
            "tiny": torch.randn(2, 3, generator=gen),  # 2 rows over 4: two ranks hold none
        }
        tensors = {
            "embed": distribute_tensor(full["embed"], flat, [Shard(0)]),
            "q": distribute_tensor(full["q"], grid, [Shard(0), Shard(1)]),
            "norm": distribute_tensor(full["norm"], flat, [Replicate()]),
            "tiny": distribute_tensor(full["tiny"], flat, [Shard(0)]),
        }
        # Expert parallel: expert e lives whole on rank e only (a plain tensor there).
        experts = {f"expert.{e}": torch.full((4, 4), float(e)) for e in range(WORLD)}
        pieces = [describe(name, t) for name, t in tensors.items()]
        for name, tensor in experts.items():
            owner = int(name.split(".")[1])
            piece = describe(name, tensor)
            pieces.append(piece if owner == rank else type(piece)(piece.meta, None, None))
        try:  # a gradient-like pending sum: each rank holds an addend
            addend = DTensor.from_local(torch.ones(5, 6), grid, [Partial(), Shard(1)])
            describe("bad", addend)
            refused = ""
        except ShardError as exc:
            refused = str(exc)
        result = {
            "pieces": [(p.meta, p.box, p.local) for p in pieces],
            "full": {n: t.full_tensor() for n, t in tensors.items()} | experts,
            "refused": refused,
        }
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        # Every rank past its last collective before any tears its groups down: a rank
        # destroying the mesh's groups while a peer still talks to it aborted once in
        # gloo ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_every_rank_describes_its_piece_and_the_plan_rebuilds_the_full_tensors(
    tmp_path: Path,
) -> None:
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    # Written by this test's own child processes (tensors and dataclasses: not JSON).
    ranks = [
        pickle.loads(Path(tmp_path, f"rank{r}.pkl").read_bytes())  # noqa: S301
        for r in range(WORLD)
    ]
    reports = [
        RankReport(r, tuple((meta, box) for meta, box, _ in ranks[r]["pieces"]))
        for r in range(WORLD)
    ]
    plan = plan_shards(reports, bucket_size_bytes=256)
    assert plan.owners == (0, 1, 2, 3)
    held = {
        r: {meta.name: local for meta, box, local in ranks[r]["pieces"] if box is not None}
        for r in range(WORLD)
    }
    assert sorted(held[2]) == sorted(["embed", "q", "norm", "expert.2"])  # no piece of tiny
    layout = plan.layout
    full = ranks[0]["full"]
    for bucket, segments in zip(layout.buckets, plan.segments, strict=True):
        slot = torch.zeros(layout.capacity_bytes, dtype=torch.uint8)
        staging = torch.zeros(max(plan.staging_bytes, 1), dtype=torch.uint8)
        for segment in segments:
            sent = torch.zeros_like(slot if segment.direct else staging)
            pack_segment(segment, held[segment.owner], sent)
            span = slice(segment.offset, segment.offset + segment.nbytes)
            (slot if segment.direct else staging)[span] = sent[span]
            place_pieces(bucket, segment, staging, slot)
        for item in bucket.tensors:
            got = slot[item.offset : item.offset + item.nbytes].view(torch.float32)
            assert torch.equal(got.view(item.shape), full[item.name]), item.name
    assert all("Partial placement" in r["refused"] for r in ranks), ranks[0]["refused"]
