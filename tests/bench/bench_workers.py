"""Per-GPU worker processes of the broadcast benchmark (one process per GPU, rank = GPU).

Rank 0 plays the trainer and reports its timings; every timing ends with a collective
that completes only when all ranks are done.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ProcessGroupNCCL,
    TCPStore,
)

from tests.integration.stack import free_port
from weightsync.engines.reference import ReferenceEngineAdapter
from weightsync.reference.model import preset, state_dict_metas
from weightsync.transfer.buffers import BucketSlots, torch_dtype
from weightsync.transfer.layout import TensorSlice, align_up

Worker = Callable[[int, int, TCPStore, dict[str, Any]], dict[str, float]]


def _tensors(rank: int, kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    out = []
    config = preset(kwargs["preset"], kwargs.get("layers"))
    for i, meta in enumerate(state_dict_metas(config, "bfloat16")):
        tensor = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=f"cuda:{rank}")
        if rank == 0:
            tensor.fill_((i % 97) / 97.0)
        out.append((meta.name, tensor))
    torch.cuda.synchronize()
    return out


def _store_barrier(store: TCPStore, key: str, world: int) -> None:
    store.add(key, 1)
    while store.add(key, 0) < world:
        time.sleep(0.0005)


def _pg(store: TCPStore, prefix: str, rank: int, world: int) -> ProcessGroupNCCL:
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=300)
    return ProcessGroupNCCL(PrefixStore(prefix, store), rank, world, opts)


def _broadcast_all(pg: ProcessGroupNCCL, tensors: list[torch.Tensor]) -> None:
    opts = BroadcastOptions()
    opts.rootRank = 0
    for tensor in tensors:
        pg.broadcast([tensor], opts)  # type: ignore[attr-defined]
    done = torch.zeros(1, device=tensors[0].device)
    pg.allreduce([done], AllreduceOptions()).wait()  # type: ignore[attr-defined]
    torch.cuda.synchronize()


def raw_worker(rank: int, world: int, store: TCPStore, kwargs: dict[str, Any]) -> dict[str, float]:
    device = torch.device(f"cuda:{rank}")
    tensors = [t for _, t in _tensors(rank, kwargs)]

    cold = _pg(store, "cold/", rank, world)
    _store_barrier(store, "cold-start", world)
    started = time.perf_counter()
    _broadcast_all(cold, tensors)
    cold_first = time.perf_counter() - started

    warm = _pg(store, "warm/", rank, world)
    _store_barrier(store, "warm-start", world)
    started = time.perf_counter()
    warm.eager_connect_single_device(device)
    barrier = BarrierOptions()
    barrier.device_ids = [rank]
    warm.barrier(barrier).wait()  # type: ignore[attr-defined]
    probe = torch.zeros(4096, dtype=torch.uint8, device=device)
    opts = BroadcastOptions()
    opts.rootRank = 0
    warm.broadcast([probe], opts).wait()  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    prewarm = time.perf_counter() - started
    _store_barrier(store, "warm-first", world)
    started = time.perf_counter()
    _broadcast_all(warm, tensors)
    warm_first = time.perf_counter() - started

    floors = []
    for rep in range(kwargs["reps"]):
        _store_barrier(store, f"floor-{rep}", world)
        started = time.perf_counter()
        _broadcast_all(warm, tensors)
        floors.append(time.perf_counter() - started)
    out = {
        "cold_first": cold_first,
        "prewarm": prewarm,
        "warm_first": warm_first,
        "floor": statistics.median(floors),
    }
    # The same bytes as one flat buffer in chunks of each bucket size: the wire's pace for
    # that size with nothing else to do (one chunk-sized buffer, broadcast again and again).
    total = sum(t.numel() * t.element_size() for t in tensors)
    for chunk in kwargs["chunks"]:
        buffer = torch.empty(chunk, dtype=torch.uint8, device=device)
        pieces = [buffer] * (total // chunk) + ([buffer[: total % chunk]] if total % chunk else [])
        times = []
        for rep in range(kwargs["reps"] + 1):
            _store_barrier(store, f"chunked-{chunk}-{rep}", world)
            started = time.perf_counter()
            _broadcast_all(warm, pieces)
            times.append(time.perf_counter() - started)
        out[f"chunked_{chunk}"] = statistics.median(times[1:])
        del buffer, pieces
    return out


def naive_worker(
    rank: int, world: int, store: TCPStore, kwargs: dict[str, Any]
) -> dict[str, float]:
    """One broadcast and one HTTP engine update request per tensor (what weightsync replaces)."""
    device = torch.device(f"cuda:{rank}")
    named = _tensors(rank, kwargs)
    pg = _pg(store, "naive/", rank, world)
    _broadcast_all(pg, [torch.zeros(1, device=device)])  # connect outside the timing
    opts = BroadcastOptions()
    opts.rootRank = 0

    async def sink(url: str) -> None:
        capacity = align_up(max(t.numel() * t.element_size() for _, t in named), 256)
        slots = BucketSlots(1, capacity, device, "/dev/shm")
        # HTTP per tensor, as an engine's plain update endpoint would be driven.
        adapter = ReferenceEngineAdapter(url, request_timeout_seconds=600, use_channel=False)
        try:
            await adapter.attach_buffers(slots.slots)
            await adapter.begin_update(kwargs["version"])
            for name, tensor in named:
                nbytes = tensor.numel() * tensor.element_size()
                view = slots.slots[0][:nbytes].view(tensor.dtype).view(tensor.shape)
                pg.broadcast([view], opts).wait()  # type: ignore[attr-defined]
                torch.cuda.current_stream().synchronize()
                dtype = str(tensor.dtype).removeprefix("torch.")
                slice_ = TensorSlice(name, dtype, tuple(tensor.shape), 0, nbytes)
                await adapter.load_bucket(0, [slice_])
            await adapter.finish_update(kwargs["version"])
        finally:
            await adapter.close()
            slots.close()

    _store_barrier(store, "naive-start", world)
    started = time.perf_counter()
    if rank == 0:
        for _, tensor in named:
            pg.broadcast([tensor], opts)  # type: ignore[attr-defined]
    else:
        asyncio.run(sink(kwargs["engines"][rank - 1]))
    done = torch.zeros(1, device=device)
    pg.allreduce([done], AllreduceOptions()).wait()  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    return {"naive": time.perf_counter() - started}


def _entry(  # noqa: PLR0917 - the positional target of multiprocessing.Process
    worker: Worker,
    rank: int,
    world: int,
    port: int,
    kwargs: dict[str, Any],
    results: multiprocessing.Queue[dict[str, float]],
) -> None:
    if kwargs.get("backend", "nccl") == "nccl":  # the sharded floors' smoke run: gloo
        torch.cuda.set_device(rank)
    store = TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=300))
    out = worker(rank, world, store, kwargs)
    if rank == 0:
        results.put(out)
    # Rank 0 hosts the store: it leaves last, once every rank has checked out.
    store.add("exit", 1)
    while rank == 0 and store.add("exit", 0) < world:
        time.sleep(0.001)


def spawn_workers(worker: Worker, world: int, kwargs: dict[str, Any]) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[dict[str, float]] = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_entry, args=(worker, rank, world, port, kwargs, results))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    return out
