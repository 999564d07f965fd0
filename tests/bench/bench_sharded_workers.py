"""Processes of the sharded benchmark: trainer ranks holding `Shard(0)` DTensors, and the
raw broadcast floors over every GPU (one process per GPU or, on CPU, per gloo rank).

Each trainer rank builds only its own dim-0 shard of every tensor (the rows torch.chunk
gives it, as FSDP2 and `distribute_tensor` cut them), filled from the element's global
index and the version, so the full tensors exist nowhere on the trainer side and any
process can rebuild one of them bit for bit to check what the engines serve.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before torch/NCCL load: multicast stays off

import itertools
import math
import multiprocessing
import queue
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from tests.bench.bench_workers import _store_barrier
from tests.integration.stack import free_port
from weightsync.reference.model import preset, state_dict_metas
from weightsync.transfer.layout import TensorMeta

_FILL_CHUNK = 1 << 26  # elements per fill step: bounds the int64 index scratch (512 MiB)
_REPLY_SECONDS = 900.0


def model_metas(kwargs: dict[str, Any]) -> list[TensorMeta]:
    return state_dict_metas(preset(kwargs["preset"], kwargs.get("layers")), "bfloat16")


def owned_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """(first row, row count) of `rank`'s `Shard(0)` piece: torch.chunk's split, where
    the last ranks get fewer rows, or none."""
    step = -(-rows // world)
    start = min(rank * step, rows)
    return start, max(0, min(step, rows - start))


def owned_bytes(metas: list[TensorMeta], rank: int, world: int) -> list[int]:
    """The sizes of `rank`'s non-empty shards, in state-dict order."""
    out = []
    for meta in metas:
        _, count = owned_rows(meta.shape[0], rank, world)
        if count:
            out.append(meta.nbytes // meta.shape[0] * count)
    return out


def uneven(metas: list[TensorMeta], world: int) -> list[str]:
    return [m.name for m in metas if m.shape[0] % world]


def fill_(out: torch.Tensor, first: int, salt: int) -> None:
    """Element k (global flat index `first + k`) = ((31 (first + k) + salt) mod 509 - 254)
    / 256: exact in bf16, non-constant, the same bits wherever it is computed."""
    flat = out.view(-1)
    for at in range(0, flat.numel(), _FILL_CHUNK):
        part = flat[at : at + _FILL_CHUNK]
        index = torch.arange(first + at, first + at + part.numel(), device=out.device)
        part.copy_(index.mul_(31).add_(salt).remainder_(509).sub_(254))
        part.mul_(1 / 256)


def salt(index: int, version: int) -> int:
    return index * 7 + version


@dataclass
class RankReply:
    """One trainer rank's answer to a round: its publish() wall time from the barrier."""

    rank: int
    ok: bool
    elapsed: float
    duration_seconds: float  # the agent's own round time (until every engine committed)
    result: dict[str, Any]
    timings: dict[str, float] | None
    fence: float  # `fence()` right after publish(): the rest of a holder's copy


def _local_state(
    metas: list[TensorMeta], rank: int, world: int, device: torch.device
) -> list[tuple[TensorMeta, int, torch.Tensor]]:
    out = []
    for meta in metas:
        start, count = owned_rows(meta.shape[0], rank, world)
        local = torch.empty((count, *meta.shape[1:]), dtype=torch.bfloat16, device=device)
        out.append((meta, start * math.prod(meta.shape[1:]), local))
    return out


def _check_cut(state: list[tuple[TensorMeta, int, torch.Tensor]], mesh: Any, version: int) -> None:
    """Small models: the pieces built here are the ones `distribute_tensor` cuts."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for i, (meta, _, local) in enumerate(state):
        full = torch.empty(meta.shape, dtype=torch.bfloat16, device=local.device)
        fill_(full, 0, salt(i, version))
        cut = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local()
        if not torch.equal(cut, local):
            raise RuntimeError(f"{meta.name}: local shard differs from distribute_tensor's")


def full_digests(metas: list[TensorMeta], version: int, device: torch.device) -> dict[str, str]:
    """The full tensors of `version`, rebuilt one at a time, as the engines digest them."""
    from weightsync.reference.memory import tensor_digest

    out = {}
    for i, meta in enumerate(metas):
        full = torch.empty(meta.shape, dtype=torch.bfloat16, device=device)
        fill_(full, 0, salt(i, version))
        out[meta.name] = tensor_digest(full)
    return out


def trainer_rank(  # noqa: PLR0917 - the positional target of multiprocessing.Process
    rank: int, world: int, port: int, socket: str, kwargs: dict[str, Any], inbox: Any, outbox: Any
) -> None:
    """One trainer rank: answers "ready", then one `RankReply` per ("publish", version) and
    the full digests (rank 0; None elsewhere) per ("digests", version)."""
    try:
        _trainer_loop(rank, world, port, socket, kwargs, inbox, outbox)
    except BaseException:
        outbox.put(("error", f"trainer rank {rank}:\n{traceback.format_exc()}"))
        raise


def _trainer_loop(  # noqa: PLR0917 - see trainer_rank
    rank: int, world: int, port: int, socket: str, kwargs: dict[str, Any], inbox: Any, outbox: Any
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from weightsync.client import Publisher

    nccl = kwargs["backend"] == "nccl"
    device = torch.device(f"cuda:{rank}" if nccl else "cpu")
    if nccl:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=300))
    dist.init_process_group(
        "nccl" if nccl else "gloo", store=store, rank=rank, world_size=world,
        device_id=device if nccl else None,
    )  # fmt: skip
    mesh = init_device_mesh(device.type, (world,))
    metas = model_metas(kwargs)
    state = _local_state(metas, rank, world, device)
    if kwargs.get("check"):
        for i, (_, first, local) in enumerate(state):
            fill_(local, first, salt(i, 0))
        _check_cut(state, mesh, 0)
    tensors = {
        meta.name: DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False,
            shape=torch.Size(meta.shape), stride=torch.empty(meta.shape, device="meta").stride(),
        )
        for meta, _, local in state
    }  # fmt: skip
    barrier = {"device_ids": [rank]} if nccl else {}
    try:
        with Publisher(socket, timeout=600) as publisher:
            outbox.put(("ready", rank))
            while (command := inbox.get()) is not None:
                kind, version = command
                if kind == "digests":
                    outbox.put(
                        ("digests", full_digests(metas, version, device) if rank == 0 else None)
                    )
                    continue
                for i, (_, first, local) in enumerate(state):  # in place: an optimizer step
                    fill_(local, first, salt(i, version))
                if nccl:
                    torch.cuda.synchronize()
                dist.barrier(**barrier)  # every rank calls publish() at the same moment
                started = time.perf_counter()
                result = publisher.publish(tensors, version=version)
                elapsed = time.perf_counter() - started
                timings = publisher.last_timings
                fenced = time.perf_counter()
                publisher.fence()  # the holder's copy no longer reads what the next refill writes
                reply = RankReply(
                    rank, result.ok, elapsed, result.duration_seconds, result.model_dump(),
                    None if timings is None else asdict(timings), time.perf_counter() - fenced,
                )  # fmt: skip
                outbox.put(("round", reply))
    finally:
        dist.destroy_process_group()


class Trainers:
    """The trainer ranks, one process each (on cuda:rank, or CPU), driven round by round."""

    def __init__(self, sockets: list[str], kwargs: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")
        port, world = free_port(), len(sockets)
        self.inboxes = [context.Queue() for _ in sockets]
        self.outboxes = [context.Queue() for _ in sockets]
        self.procs = [
            context.Process(
                target=trainer_rank,
                args=(rank, world, port, s, kwargs, self.inboxes[rank], self.outboxes[rank]),
                name=f"trainer-{rank}",
            )
            for rank, s in enumerate(sockets)
        ]
        for proc in self.procs:
            proc.start()
        self._answers("ready")

    def _answers(self, kind: str) -> list[Any]:
        out = []
        for rank, outbox in enumerate(self.outboxes):
            deadline = time.monotonic() + _REPLY_SECONDS
            while True:  # a rank that dies without a word fails the bench now, not later
                try:
                    got, value = outbox.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self.procs[rank].is_alive() or time.monotonic() > deadline:
                        got, value = "nothing", f"exit code {self.procs[rank].exitcode}"
                        break
            if got != kind:
                raise RuntimeError(f"trainer rank {rank} answered {got}: {value}")
            out.append(value)
        return out

    def publish(self, version: int) -> list[RankReply]:
        for inbox in self.inboxes:
            inbox.put(("publish", version))
        replies: list[RankReply] = self._answers("round")
        return replies

    def digests(self, version: int) -> dict[str, str]:
        for inbox in self.inboxes:
            inbox.put(("digests", version))
        digests: dict[str, str] = self._answers("digests")[0]
        return digests

    def close(self) -> None:
        for inbox, proc in zip(self.inboxes, self.procs, strict=True):
            if proc.is_alive():
                inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def floor_worker(
    rank: int, world: int, store: TCPStore, kwargs: dict[str, Any]
) -> dict[str, float]:
    """Each owner (trainer rank r < sources) broadcasts what it holds to all `world` ranks,
    root after root: as one buffer, then shard by shard. Every timing starts at a store
    barrier and ends with an all-reduce, so it covers the slowest rank."""
    nccl = kwargs["backend"] == "nccl"
    device = torch.device(f"cuda:{rank}" if nccl else "cpu")
    dist.init_process_group(
        "nccl" if nccl else "gloo", store=store, rank=rank, world_size=world,
        device_id=device if nccl else None,
    )  # fmt: skip
    metas = model_metas(kwargs)
    sizes = [
        owned_bytes(metas, owner, world=kwargs["sources"]) for owner in range(kwargs["sources"])
    ]
    # One scratch buffer, as large as the largest owner's bytes: owners broadcast in turn.
    buffer = torch.empty(max(sum(s) for s in sizes), dtype=torch.uint8, device=device)
    one_buffer = [[buffer[: sum(s)]] for s in sizes]
    shard_by_shard = []
    for owner_sizes in sizes:
        offsets = [0, *itertools.accumulate(owner_sizes)]
        shard_by_shard.append([buffer[a:b] for a, b in itertools.pairwise(offsets)])

    def broadcast(pieces_by_owner: list[list[torch.Tensor]]) -> None:
        for owner, pieces in enumerate(pieces_by_owner):
            for piece in pieces:
                dist.broadcast(piece, src=owner)
        dist.all_reduce(torch.zeros(1, device=device))
        if nccl:
            torch.cuda.synchronize()

    out = {}
    for name, pieces in (("one_buffer", one_buffer), ("shard_by_shard", shard_by_shard)):
        times = []
        for rep in range(kwargs["reps"] + 1):  # the first: connections, not counted
            _store_barrier(store, f"{name}-{rep}", world)
            started = time.perf_counter()
            broadcast(pieces)
            times.append(time.perf_counter() - started)
        out[name] = statistics.median(times[1:])
    dist.destroy_process_group()
    return out
