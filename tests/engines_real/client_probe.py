"""The trainer's side of weightsync on another torch: run by `test_client_torch.py` with
an engine venv's Python (its own torch and pydantic) and this repository on PYTHONPATH,
as a trainer image that installed `weightsync[client]` beside its torch would.

    python -m tests.engines_real.client_probe shards OUT_DIR
        four gloo ranks describe DTensors (uneven Shard(0), Shard(0)+Shard(1) on a 2x2
        mesh, Replicate, shards that are empty); each rank writes to OUT_DIR what differs
        from `full_tensor()` (nothing when the client's boxes are right on this torch)
    python -m tests.engines_real.client_probe publish SOCKET PRESET VERSIONS
        publishes VERSIONS versions of the reference model through the source agent at
        SOCKET; prints one JSON line a version: ok, reason and every tensor's sha256
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from weightsync.client.shards import ShardError, describe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    problems: list[str] = []
    try:
        flat = init_device_mesh("cpu", (WORLD,))
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        gen = torch.Generator().manual_seed(11)
        tensors = {
            "embed": distribute_tensor(torch.randn(33, 8, generator=gen), flat, [Shard(0)]),
            "q": distribute_tensor(torch.randn(10, 13, generator=gen), grid, [Shard(0), Shard(1)]),
            "rows": distribute_tensor(torch.randn(7, 3, generator=gen), grid, [Shard(0), Shard(0)]),
            "norm": distribute_tensor(torch.randn(12, generator=gen), flat, [Replicate()]),
            "tiny": distribute_tensor(torch.randn(2, 3, generator=gen), flat, [Shard(0)]),
            "last": distribute_tensor(torch.randn(3, 5, generator=gen), flat, [Shard(-1)]),
        }
        for name, tensor in tensors.items():
            piece = describe(name, tensor)
            full = tensor.full_tensor()
            if piece.box is None:
                if tensor.to_local().numel():
                    problems.append(f"{name}: described as empty, holds {tensor.to_local().shape}")
                continue
            block = full[
                tuple(
                    slice(o, o + s) for o, s in zip(piece.box.offset, piece.box.shape, strict=True)
                )
            ]
            if piece.local is None or not torch.equal(piece.local, block):
                problems.append(f"{name}: box {piece.box} is not the bytes this rank holds")
        try:
            describe("bad", DTensor.from_local(torch.ones(5, 6), grid, [Partial(), Shard(1)]))
            problems.append("a Partial placement was not refused")
        except ShardError:
            pass
        Path(out, f"rank{rank}.json").write_text(json.dumps(problems))
    finally:
        dist.destroy_process_group()


def shards(out: str) -> None:
    mp.spawn(_rank, args=(_free_port(), out), nprocs=WORLD)


def publish(socket_path: str, preset: str, versions: int) -> None:
    from weightsync.client import Publisher
    from weightsync.reference.memory import tensor_digest
    from weightsync.reference.model import PRESETS, build_model, randomize

    model = build_model(PRESETS[preset], seed=0, device="cpu")
    with Publisher(Path(socket_path), timeout=60.0) as publisher:
        for version in range(1, versions + 1):
            randomize(model, seed=1000 + version)
            result = publisher.publish(model.named_parameters(), version=version)
            digests = {name: tensor_digest(p) for name, p in model.named_parameters()}
            line = {"version": version, "ok": result.ok, "reason": result.reason}
            print(json.dumps(line | {"tensors": digests}), flush=True)


def main(argv: list[str]) -> None:
    print(json.dumps({"torch": torch.__version__}), flush=True)
    if argv[0] == "shards":
        shards(argv[1])
    elif argv[0] == "publish":
        publish(argv[1], argv[2], int(argv[3]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
