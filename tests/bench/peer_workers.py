"""checkpoint-engine's side of `bench_peer`: a parameter server and a receiver per GPU.

`run_peer` starts every process from the benchmark's own, so it can stop them all when
one fails or the run overstays:

* one checkpoint-engine `ParameterServer` per GPU (rank = GPU). GPU 0 is the trainer's:
  its server registers the trainer's tensors on that GPU (the copy to pinned host memory)
  and owns every bucket. GPUs 1.. are engine GPUs.
* one receiver per GPU, on the server's GPU: the engine's side. It holds the model's
  weights as GPU tensors and loads each bucket through checkpoint-engine's own
  `update_weights_from_ipc` (ZMQ + CUDA IPC), copying into those weights. In broadcast
  mode every server hands every bucket to the receiver on its GPU, rank 0's included:
  the trainer's GPU serves no model, so its receiver only acknowledges.

checkpoint-engine calls a server's `req_func` in a thread with every GPU's socket; here
it tells the receiver on its GPU which socket to serve and returns once that receiver
has loaded the whole checkpoint (as an engine's update request would).

Per repetition, rank 0 times: `register_checkpoint` (the trainer's tensors copied into
the shared pinned pool), `gather_metas`, and `update` until every rank's `update`
returned (a store barrier: after its first use, checkpoint-engine's own store barrier
no longer waits, and in P2P mode rank 0 leaves `update` early). Then, untimed, every
receiver's weights are checked against the trainer's (a checksum per tensor), and the
next repetition fills the trainer's tensors with other values.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore

from tests.integration.stack import free_port
from weightsync.reference.model import preset, state_dict_metas
from weightsync.transfer.buffers import torch_dtype

HOST = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=600)
PHASES = ("register", "gather", "update")


def model_tensors(kwargs: dict[str, Any], device: str, *, zeros: bool) -> dict[str, torch.Tensor]:
    metas = state_dict_metas(preset(kwargs["preset"], kwargs["layers"]), "bfloat16")
    make = torch.zeros if zeros else torch.empty
    return {m.name: make(m.shape, dtype=torch_dtype(m.dtype), device=device) for m in metas}


def fill(state: dict[str, torch.Tensor], rep: int) -> None:
    """Repetition 0 holds `bench_broadcast.trainer_state`'s values; each next one others."""
    for i, tensor in enumerate(state.values()):
        tensor.fill_(((i + rep) % 97) / 97.0)
    torch.cuda.synchronize()


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """Each tensor's sum of its 16-bit words (bf16): a tensor missing, stale or swapped shows."""
    sums = [t.view(-1).view(torch.int16).sum(dtype=torch.int64) for t in tensors]
    return hashlib.sha256(str(torch.stack(sums).tolist()).encode()).hexdigest()


def store_barrier(store: TCPStore, key: str, world: int) -> None:
    store.add(key, 1)
    while store.add(key, 0) < world:
        time.sleep(0.0005)


def receive(rank: int, conn: Connection, kwargs: dict[str, Any]) -> None:
    """The engine on GPU `rank`: loads each update into its weights until told to exit."""
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    torch.cuda.set_device(rank)
    weights = {} if rank == 0 else model_tensors(kwargs, f"cuda:{rank}", zeros=True)
    torch.cuda.synchronize()

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        torch._foreach_copy_([weights[name] for name, _ in named], [t for _, t in named])

    def acknowledge(named: list[tuple[str, torch.Tensor]]) -> None:
        del named  # the trainer's GPU: nothing to load

    context = zmq.Context()
    conn.send(("ready", ""))
    while True:
        command, argument = conn.recv()
        if command == "update":
            try:
                run = load if weights else acknowledge
                update_weights_from_ipc(context, argument, device_id=rank, run=run)
            except Exception:  # the server fails the run with it
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("done", ""))
        elif command == "digest":
            conn.send(("digest", digest(weights.values())))
        else:
            context.term()
            return


def serve(
    rank: int, world: int, ports: tuple[int, int], conn: Connection, kwargs: dict[str, Any]
) -> dict[str, list[float]]:
    """checkpoint-engine's parameter server on GPU `rank`; rank 0 returns the timings."""
    mode = kwargs["mode"]
    # ParameterServer reads RANK (rank 0 is falsy as an argument), so does its P2P store.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=HOST)
    os.environ.setdefault("LOGURU_LEVEL", "WARNING")  # its per-bucket lines, 2G processes
    if mode != "p2p":
        # Broadcast needs no P2P store: as installed without its `p2p` extra. With Mooncake
        # importable, ParameterServer() fails on a host without RDMA NICs.
        sys.modules["mooncake.engine"] = None  # type: ignore[assignment]
    from checkpoint_engine.ps import ParameterServer

    torch.cuda.set_device(rank)
    store = TCPStore(HOST, ports[0], world, rank == 0, STORE_TIMEOUT)
    state = model_tensors(kwargs, "cuda:0", zeros=False) if rank == 0 else {}
    server = ParameterServer(
        rank=rank,
        world_size=world,
        auto_pg=mode == "auto_pg",
        master_addr=HOST,
        master_port=ports[1],
    )
    if mode != "auto_pg":
        server.init_process_group()  # kept for every update; gather_metas needs it first
    if conn.recv()[0] != "ready":
        raise RuntimeError(f"receiver {rank} did not start")
    uuid = f"GPU-{torch.cuda.get_device_properties(rank).uuid}"  # as checkpoint-engine names it
    failures: list[str] = []

    def req_func(socket_paths: list[tuple[str, str]]) -> None:
        conn.send(("update", dict(socket_paths)[uuid]))
        kind, detail = conn.recv()
        if kind != "done":
            failures.append(detail)

    ranks = list(range(1, world)) if mode == "p2p" else None
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for rep in range(kwargs["warmup"] + kwargs["reps"]):
        name = f"bench-{rep}"
        if rank == 0:
            fill(state, rep)
        store_barrier(store, f"start-{rep}", world)
        started = time.perf_counter()
        if rank == 0:
            server.register_checkpoint(name, named_tensors=state, use_shared_memory_pool=True)
        registered = time.perf_counter()
        server.gather_metas(name)
        gathered = time.perf_counter()
        server.update(name, req_func, ranks=ranks)
        store_barrier(store, f"updated-{rep}", world)
        updated = time.perf_counter()
        if failures:
            raise RuntimeError(f"receiver {rank}: {failures[0]}")
        if rank == 0:
            server.unregister_checkpoint(name)  # the pool stays for the next version
        verify(rank, world, store, conn, rep=rep, state=state)
        if rep >= kwargs["warmup"]:
            spans = (registered - started, gathered - registered, updated - gathered)
            for phase, seconds in zip(PHASES, spans, strict=True):
                times[phase].append(seconds)
    conn.send(("exit", ""))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    leave(rank, world, store)
    return times


def verify(
    rank: int, world: int, store: TCPStore, conn: Connection, *, rep: int, state: dict[str, Any]
) -> None:
    """Every engine GPU's weights equal the trainer's tensors of repetition `rep`."""
    if rank > 0:
        conn.send(("digest", ""))
        store.set(f"digest-{rep}-{rank}", conn.recv()[1])
        return
    expected = digest(state.values())
    wrong = [r for r in range(1, world) if store.get(f"digest-{rep}-{r}").decode() != expected]
    if wrong:
        raise RuntimeError(f"repetition {rep}: weights on GPUs {wrong} differ from the trainer's")


def leave(rank: int, world: int, store: TCPStore) -> None:
    """Rank 0 hosts the store: it leaves last, once every rank has checked out."""
    store.add("left", 1)
    while rank == 0 and store.add("left", 0) < world:
        time.sleep(0.001)


def _entry(
    target: Callable[..., Any],
    rank: int,
    args: tuple[Any, ...],
    results: multiprocessing.Queue[tuple[str, Any]],
    name: str,
) -> None:
    try:
        out = target(rank, *args)
    except BaseException:
        results.put(("error", f"{name}:\n{traceback.format_exc()}"))
        raise SystemExit(1) from None  # run_peer prints it, once
    if out is not None and rank == 0:
        results.put(("times", out))


def run_peer(
    mode: str, world: int, kwargs: dict[str, Any], timeout: float
) -> dict[str, list[float]]:
    """One set of processes for `mode` (kept, auto_pg or p2p); rank 0's timings per phase."""
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[tuple[str, Any]] = context.Queue()
    ports = (free_port(), free_port())
    while ports[1] == ports[0]:
        ports = (ports[0], free_port())
    kwargs = {**kwargs, "mode": mode}
    procs = []
    for rank in range(world):
        server_end, receiver_end = context.Pipe()
        for target, args, name in (
            (receive, (receiver_end, kwargs), f"receiver {rank}"),
            (serve, (world, ports, server_end, kwargs), f"server {rank}"),
        ):
            procs.append(
                context.Process(target=_entry, args=(target, rank, args, results, name), name=name)
            )
    for proc in procs:
        proc.start()
    finished = False
    try:
        times = _wait(procs, results, f"checkpoint-engine {mode}", timeout)
        finished = True
        return times
    finally:
        for proc in procs:
            proc.join(timeout=120 if finished else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        failed = [f"{p.name} ({p.exitcode})" for p in procs if p.exitcode]
        if finished and failed:
            print(f"warning: {mode}: exit codes after the run: {', '.join(failed)}", flush=True)


def _wait(
    procs: Sequence[multiprocessing.process.BaseProcess],
    results: multiprocessing.Queue[tuple[str, Any]],
    what: str,
    timeout: float,
) -> dict[str, list[float]]:
    """Rank 0's timings, or the first failure: an error, a process gone, or the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kind, payload = results.get(timeout=1)
        except queue.Empty:
            dead = [f"{p.name} ({p.exitcode})" for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{what}: exited: {', '.join(dead)}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: no result in {timeout:.0f} s") from None
            continue
        if kind == "error":
            raise RuntimeError(f"{what}: {payload}")
        return dict(payload)
