"""The reference engine with tensor-parallel workers: one process per device.

`--tp N` runs N workers beside the server process, which keeps the HTTP routes and the
update channel. Worker w runs on the w-th device from `--device` (`cuda:k` gives
`cuda:k+w`; on the CPU every worker is on the CPU) and holds a whole `ReferenceEngine`
of its own. It loads every bucket from its own copy of the agent's slot, as a real TP
engine's rank reads only the copy on its own GPU: the copy on its GPU (found by UUID),
on the CPU the copy at its index (`SlotHandles.copy_for`). A real engine would hold a
shard per rank; a whole model per worker lets a test prove every device bit for bit.

All or nothing across workers: every update call goes to every worker and fails if it
failed on any. A commit is two-phase: every worker first confirms it holds the whole
version (`ready`), then all switch; a worker that fails the switch after that (it died
or hung) leaves the engine torn, which health reports until an update lands on all.
Generation runs on every worker and their answers must agree; a worker that exited
makes the engine unhealthy.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from weightsync.api.engines import MemoryTag
from weightsync.engines.base import EngineError, EngineHealth
from weightsync.reference.arenas import Arena, BucketPlan, make_plan
from weightsync.reference.memory import Sleep
from weightsync.reference.model import build_model, preset
from weightsync.reference.tp_worker import (
    Call,
    Result,
    WorkerDigest,
    WorkerSpec,
    serve,
    worker_devices,
)
from weightsync.transfer.buffers import SlotHandle, SlotHandles, torch_dtype
from weightsync.transfer.layout import TensorSlice

log = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 600.0  # workers import torch and build their model: slow on 2 cores
CLOSE_TIMEOUT_SECONDS = 10.0
DISAGREE = "workers disagree"  # a tensor's digest where workers hold different bytes


class _Worker:
    def __init__(self, index: int, process: BaseProcess, conn: Connection, device: str) -> None:
        self.index = index
        self.process = process
        self.conn = conn
        self.device = device

    def name(self) -> str:
        return f"worker {self.index} ({self.device})"

    def receive(self, seq: int, deadline: float, what: str) -> Result:
        """The answer to call `seq`; answers to calls that timed out earlier are dropped."""
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0 or not self.conn.poll(remaining):
                    raise EngineError("timeout", f"{self.name()}: no answer to {what}")
                result: Result = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise EngineError("worker_lost", f"{self.name()} exited ({what})") from exc
            if result.seq == seq:
                return result


class TensorParallelEngine:
    """A `ServedEngine` whose every call runs on each of its workers."""

    def __init__(self, spec: WorkerSpec, tp: int, *, call_timeout_seconds: float = 60.0) -> None:
        if tp < 1:
            raise ValueError("a tensor-parallel engine has at least one worker")
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._workers: list[_Worker] = []
        self._timeout = call_timeout_seconds
        self._lock = threading.Lock()  # one call at a time, on every worker
        self._seq = 0
        for index, device in enumerate(worker_devices(spec.device, tp)):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=serve,
                args=(theirs, replace(spec, device=device), index),
                name=f"ref-worker-{index}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._workers.append(_Worker(index, process, ours, device))
        self._await_start()
        config = preset(spec.preset, spec.layers)
        meta = build_model(config, None, dtype=torch_dtype(spec.dtype), device="meta")
        self._params = dict(meta.named_parameters())  # checks buckets here, once each
        self._plans: dict[tuple[TensorSlice, ...], BucketPlan] = {}
        self._numbers: dict[BucketPlan, int] = {}  # a plan's number on the workers
        self.version: int | None = None
        self.incarnation = uuid.uuid4().hex
        self._staging: int | None = None
        self._staged = 0
        self._torn = ""  # why the workers may serve different versions
        self._sleep = Sleep()  # as every worker's own (they release and resume together)

    def _await_start(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        for worker in self._workers:
            try:
                result = worker.receive(0, deadline, "start")
            except EngineError:
                self.close()
                raise
            if not result.ok:
                self.close()
                raise EngineError(result.reason, f"{worker.name()}: {result.message}")

    @property
    def tp(self) -> int:
        return len(self._workers)

    @property
    def devices(self) -> list[str]:
        return [worker.device for worker in self._workers]

    def _all(self, op: str, *args: object) -> list[Any]:
        """Call `op` on every worker at once; every answer, or the failures as one error."""
        errors: dict[int, EngineError] = {}
        results: dict[int, Result] = {}
        with self._lock:
            self._seq += 1
            call = Call(self._seq, op, args)
            deadline = time.monotonic() + self._timeout
            for worker in self._workers:
                try:
                    worker.conn.send(call)
                except OSError as exc:
                    errors[worker.index] = EngineError("worker_lost", f"{worker.name()}: {exc}")
            for worker in self._workers:
                if worker.index not in errors:
                    try:
                        results[worker.index] = worker.receive(call.seq, deadline, op)
                    except EngineError as exc:
                        errors[worker.index] = exc
        for index, result in results.items():
            if not result.ok:
                name = self._workers[index].name()
                errors[index] = EngineError(result.reason, f"{name}: {result.message}")
        if errors:
            failed = [errors[index] for index in sorted(errors)]
            raise EngineError(
                failed[0].reason,
                f"{op} failed on {len(failed)} of {self.tp} workers: "
                + "; ".join(str(error) for error in failed),
            )
        return [results[index].value for index in range(self.tp)]

    # --------------------------------------------------------------- serving
    @property
    def staged_buckets(self) -> int:
        return self._staged

    @property
    def resident_bytes(self) -> int:
        """What the workers hold in memory now, together (less while released)."""
        return sum(self._all("resident"))

    @property
    def shares_arenas(self) -> bool:
        return False  # each worker copies from its own slot copy: nothing to hand out

    def health(self) -> EngineHealth:
        gone = [w.name() for w in self._workers if not w.process.is_alive()]
        detail = "updating" if self._staging is not None else self._sleep.detail
        if self._torn:
            detail = self._torn
        if gone:
            detail = f"{', '.join(gone)} exited"
        return EngineHealth(
            healthy=not gone,
            version=self.version,
            torn=bool(self._torn),
            detail=detail,
            incarnation=self.incarnation,
            released=self._sleep.released,
        )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], int | None]:
        answers = self._all("generate", prompts, max_new_tokens)
        if any(answer != answers[0] for answer in answers):
            raise EngineError(DISAGREE, f"{DISAGREE}: {answers}")
        outputs, version = answers[0]
        return outputs, version

    def worker_digests(self) -> list[WorkerDigest]:
        digests: list[WorkerDigest] = self._all("digests")
        return digests

    def digests(self) -> tuple[int | None, dict[str, str]]:
        return agreed(self.worker_digests())

    # --------------------------------------------------------------- updates
    def attach(self, handles: SlotHandles) -> None:
        if handles.copies not in (1, self.tp):
            raise EngineError(
                "bad_slots",
                f"{handles.copies} copies of the slots for {self.tp} workers: "
                "give one copy (every worker reads it) or one per worker",
            )
        self._numbers.clear()  # new connections to new slots: describe buckets again
        self._all("attach", handles.model_dump_json())

    def begin(self, version: int) -> None:
        self._staging, self._staged = None, 0
        self._all("begin", version)
        self._staging = version

    def plan(self, tensors: Sequence[TensorSlice]) -> BucketPlan:
        key = tuple(tensors)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make_plan(self._params, key)
        return plan

    def load(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        self.load_plan(slot, self.plan(tensors))

    def load_plan(self, slot: int, plan: BucketPlan) -> None:
        number = self._numbers.get(plan)
        described = None
        if number is None:
            number = self._numbers[plan] = len(self._numbers)
            described = list(plan.tensors)
        try:
            self._all("load", slot, number, described)
        except EngineError:
            if described is not None:  # maybe not every worker learnt it: describe again
                del self._numbers[plan]
            raise
        self._staged += 1

    def stage(self, plan: BucketPlan) -> Arena:
        raise EngineError("unsupported", "tensor-parallel workers load from their own copies")

    def find_arena(self, arena_id: int) -> Arena:
        raise EngineError("unsupported", "tensor-parallel workers share no arenas")

    def arena_handle(self, arena: Arena) -> SlotHandle:
        raise EngineError("unsupported", "tensor-parallel workers share no arenas")

    def commit(self, version: int, after: bytes | None = None) -> None:
        if after is not None:  # its workers copy from slots: nobody writes its arenas
            raise EngineError("unsupported", "a tensor-parallel engine shares no arenas")
        self._all("ready", version)  # every worker holds all of it, or none switches
        try:
            self._all("commit", version)
        except EngineError as exc:
            self._torn = f"version {version} committed on some workers only: {exc}"
            raise
        self.version, self._torn = version, ""
        self._sleep.weights_gone = False
        self._staging, self._staged = None, 0

    def abort(self, version: int) -> None:
        self._staging, self._staged = None, 0
        self._all("abort", version)

    def release(self, tags: frozenset[MemoryTag]) -> frozenset[MemoryTag]:
        self._all("release", tags)
        self._sleep.released |= tags
        self._sleep.weights_gone |= MemoryTag.WEIGHTS in tags
        return tags

    def resume(self, tags: frozenset[MemoryTag]) -> None:
        self._all("resume", tags)
        self._sleep.released -= tags

    def close(self) -> None:
        for worker in self._workers:
            with contextlib.suppress(OSError):  # already gone
                worker.conn.send(Call(0, "close", ()))
        deadline = time.monotonic() + CLOSE_TIMEOUT_SECONDS
        for worker in self._workers:
            worker.process.join(max(deadline - time.monotonic(), 0.1))
            if worker.process.is_alive():
                log.warning("%s did not stop; killing it", worker.name())
                worker.process.kill()
                worker.process.join(CLOSE_TIMEOUT_SECONDS)
            worker.conn.close()


def agreed(digests: Sequence[WorkerDigest]) -> tuple[int | None, dict[str, str]]:
    """The engine's version and digests as one: a tensor whose bytes differ between
    workers, or a version they do not share, never reads as the trainer's."""
    versions = {d.version for d in digests}
    version = versions.pop() if len(versions) == 1 else None
    tensors = dict(digests[0].tensors)
    for other in digests[1:]:
        for name, digest in tensors.items():
            if other.tensors.get(name) != digest:
                tensors[name] = DISAGREE
    return version, tensors
