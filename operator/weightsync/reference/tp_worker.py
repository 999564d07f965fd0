"""One tensor-parallel worker of the reference engine: a process holding a whole
`ReferenceEngine` on its device, answering the server's calls over a pipe (the engine
of workers is `tensor_parallel`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from weightsync.engines.base import EngineError
from weightsync.reference.arenas import BucketPlan
from weightsync.reference.engine import ReferenceEngine
from weightsync.reference.model import build_model, preset
from weightsync.transfer.buffers import SlotError, SlotHandles, torch_dtype


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to build one worker's engine (the server's model flags)."""

    preset: str
    layers: int | None
    seed: int | None
    dtype: str
    device: str
    threads: int = 1
    load_delay_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerDigest:
    version: int | None
    tensors: dict[str, str]
    device: str
    loaded_bytes: int  # bytes loaded by the last update (committed or aborted)


@dataclass(frozen=True, slots=True)
class Call:
    seq: int
    op: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Result:
    seq: int
    ok: bool
    value: Any = None
    reason: str = ""
    message: str = ""


def worker_devices(first: str, tp: int) -> list[str]:
    """The device of each of `tp` workers, from `first` on."""
    device = torch.device(first)
    if device.type == "cuda":
        index = device.index or 0
        return [f"cuda:{index + w}" for w in range(tp)]
    return [str(device)] * tp


def serve(conn: Connection, spec: WorkerSpec, copy: int) -> None:
    """A worker process: build the engine, then answer calls until the server goes."""
    try:
        torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = build_model(
            preset(spec.preset, spec.layers),
            spec.seed,
            dtype=torch_dtype(spec.dtype),
            device=device,
        )
        engine = ReferenceEngine(model, load_delay_seconds=spec.load_delay_seconds)
    except Exception as exc:  # the server reports it and exits
        conn.send(Result(0, False, reason="worker_start", message=repr(exc)))
        return
    conn.send(Result(0, True))
    plans: dict[int, BucketPlan] = {}
    try:
        while True:
            try:
                call: Call = conn.recv()
            except (EOFError, OSError):
                return  # the server is gone
            if call.op == "close":
                return
            try:
                value = _dispatch(engine, plans, copy, call)
            except EngineError as exc:
                conn.send(Result(call.seq, False, reason=exc.reason, message=str(exc)))
            except SlotError as exc:
                conn.send(Result(call.seq, False, reason="bad_slots", message=str(exc)))
            else:
                conn.send(Result(call.seq, True, value))
    finally:
        engine.close()


def _dispatch(
    engine: ReferenceEngine, plans: dict[int, BucketPlan], copy: int, call: Call
) -> object:
    op, args = call.op, call.args
    if op == "load":
        slot, number, tensors = args
        if tensors is not None:  # a bucket's tensor list crosses once
            plans[number] = engine.plan(tensors)
        plan = plans.get(number)
        if plan is None:
            raise EngineError("bad_bucket", f"bucket {number} was never described")
        engine.load_plan(slot, plan)
        return None
    if op == "generate":
        return engine.generate(*args)
    if op == "digests":
        version, tensors = engine.digests()
        loaded = engine.last_update.bytes if engine.last_update is not None else 0
        return WorkerDigest(version, tensors, str(engine.device), loaded)
    if op == "attach":
        engine.attach(SlotHandles.model_validate_json(args[0]), copy)
        return None
    if op == "resident":
        return engine.resident_bytes
    calls: dict[str, Callable[..., object]] = {
        "begin": engine.begin,
        "ready": engine.ready,
        "commit": engine.commit,
        "abort": engine.abort,
        "release": engine.release,
        "resume": engine.resume,
    }
    if op not in calls:
        raise EngineError("bad_request", f"no worker call {op!r}")
    calls[op](*args)
    return None
