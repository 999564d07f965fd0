"""What source and sink rounds share: doorbell messages, store keys, outcomes, slots.

How sinks learn that a round started: a *doorbell key* in the generation's TCPStore.
The source writes `doorbell/<seq>` (the round header: version, layout hash, bucket
count) and sinks block in `store.wait` on that key between rounds. We chose this over
a header broadcast with a long idle wait because an idle collective is held open for
as long as the trainer takes between steps (minutes): it would trip the NCCL watchdog
(every collective has a timeout here), pin an NCCL kernel on the inference GPU and
leave a hung peer undetectable. A store wait costs nothing on the GPU, its timeout is
independent of the collective timeout, and the same key space carries the layout (once
per generation), the generation switch and the per-round failure flag.

A round then runs collectives only: buckets by broadcast, double-buffered by parity,
and at the end an all-reduced error flag (every rank fails together), then the
engines commit and a second vote tells the source that every engine serves it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from weightsync.agent.generations import Generation
from weightsync.api.control import PlanMember
from weightsync.engines.base import EngineError
from weightsync.transfer.broadcast import TransferError
from weightsync.transfer.buffers import BucketSlots
from weightsync.transfer.layout import BucketLayout

log = logging.getLogger(__name__)

PHASES_LOG_PREFIX = "round phases "


def doorbell_key(seq: int) -> str:
    return f"doorbell/{seq}"


def failure_key(seq: int) -> str:
    return f"failed/{seq}"


def checksum_key(seq: int) -> str:
    return f"checksums/{seq}"


def layout_key(layout_hash: str) -> str:
    return f"layout/{layout_hash}"


class RoundHeader(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["round"] = "round"
    seq: int
    version: int
    layout_hash: str
    bucket_count: int
    checksum: bool = False


class SwitchNotice(BaseModel):
    """Rounds continue in `generation`; sinks not in it go idle."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["switch"] = "switch"
    generation: int


Doorbell = Annotated[RoundHeader | SwitchNotice, Field(discriminator="kind")]
DOORBELL: TypeAdapter[Doorbell] = TypeAdapter(Doorbell)


def naming_peers(message: str, members: Sequence[PlanMember], me: int) -> str:
    """`message` with the pods behind the peer addresses it mentions (gloo names a peer
    that went away by `[ip]:port`), so a failed round says which member left."""
    named = [
        f"{m.pod} (rank {m.rank})" for m in members if m.rank != me and f"[{m.host}]" in message
    ]
    return f"{message}; peer: {', '.join(named)}" if named else message


class RoundFailed(Exception):  # noqa: N818 - an outcome carried up, named like the others
    """A round failed on this rank; `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    version: int
    generation: int | None
    ok: bool
    duration_seconds: float
    nbytes: int
    reason: str = ""
    message: str = ""
    finished_at: float = 0.0

    @classmethod
    def failed(
        cls, version: int, generation: int | None, started: float, reason: str, message: str
    ) -> RoundOutcome:
        return cls(
            version=version,
            generation=generation,
            ok=False,
            duration_seconds=time.monotonic() - started,
            nbytes=0,
            reason=reason,
            message=message,
            finished_at=time.time(),
        )


class RankRound:
    """What the source's and a sink's side of one round share: the generation's group,
    the round's failure key and deadline, the phase trace, the votes, and how a broken
    transport fails the round on this rank (flag the peers, break the generation)."""

    def __init__(self, generation: Generation, seq: int, device: torch.device) -> None:
        if generation.group is None:
            raise RoundFailed("no_group", f"generation {generation.number} is not formed")
        self.generation = generation
        self.group = generation.group
        self.seq = seq
        self.timeout = generation.plan.transfer.timeout_seconds
        self.failure_key = failure_key(seq)
        self.error: RoundFailed | None = None  # a soft failure: the round runs on, then fails
        self.trace = PhaseTrace(device)

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    async def _vote(self, flag: int, phase: str) -> int:
        """The fail-together vote: the maximum of `flag` over every rank."""
        transport, deadline = self.group.transport, self._deadline()
        started = self.trace.now()
        agreed = await self.group.run(
            lambda: transport.agree_max(flag, deadline=deadline, failure_key=self.failure_key)
        )
        self.trace.add(phase, started)
        return agreed

    def _transfer_failure(self, exc: Exception) -> tuple[str, str]:
        """(reason, message) of a transport or store failure, naming the peer it lost."""
        reason = exc.reason if isinstance(exc, TransferError) else "store_error"
        plan = self.generation.plan
        return reason, naming_peers(str(exc), plan.members, plan.rank)

    async def _flag_failure(self, version: int, label: str, reason: str, message: str) -> None:
        """Tell the peers (failure key, `label`), and break this generation."""
        log.warning("round %d (version %d) failed: %s", self.seq, version, message)

        def flag() -> None:
            try:
                self.group.ctl.set(self.failure_key, f"{label}: {reason}")
            except dist.DistError as exc:
                log.warning("could not set the failure key: %s", exc)

        try:
            await asyncio.wait_for(self.group.run(flag), 5.0)
        except TimeoutError:
            log.warning("setting the failure key timed out")
        self.generation.mark_broken(f"round {self.seq} failed: {reason}")


class SlotPool:
    """The agent's bucket slots, reallocated only when a layout needs more capacity."""

    def __init__(self, device: torch.device, shm_dir: str) -> None:
        self.device = device
        self.shm_dir = shm_dir
        self.slots: BucketSlots | None = None
        self.epoch = 0  # bumps on reallocation; consumers re-attach when it changes

    def ensure(self, layout: BucketLayout, depth: int) -> BucketSlots:
        current = self.slots
        if (
            current is not None
            and current.capacity >= layout.capacity_bytes
            and len(current.slots) == depth
        ):
            return current
        if current is not None:
            current.close()
        self.slots = BucketSlots(depth, layout.capacity_bytes, self.device, self.shm_dir)
        self.epoch += 1
        return self.slots

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None


class PhaseTrace:
    """Where one round's time goes on this rank, logged as one line when it ends.

    * spans: host time of each awaited phase (count, total, max), e.g. `fill` (the
      Publisher packing a bucket), `slot_wait` (a slot still on the wire), `recv_wait`
      (a sink waiting for a bucket), `engine_load`, the votes. The phase a rank waits on
      most is what bounds it: a source that mostly waits in `slot_wait` is wire-bound.
    * marks: host time since the round started at which a milestone was reached.
    * gpu: CUDA events recorded on the device's current stream right after a bucket's
      transfer completed (the stream waits on the collective first), so their spacing is
      the wire's pace on the GPU, whatever the host's polling added.

    `start_unix` lets a reader line up the traces of several processes on one host.
    """

    def __init__(self, device: torch.device) -> None:
        self.started = time.perf_counter()
        self.started_unix = time.time()
        self._spans: dict[str, list[float]] = {}
        self._marks: dict[str, float] = {}
        self._device = device if device.type == "cuda" else None
        self._gpu: list[tuple[str, torch.cuda.Event]] = []

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, name: str, since: float) -> None:
        """Count the time from `since` (a `now()`) to now as one `name` span."""
        seconds = time.perf_counter() - since
        entry = self._spans.get(name)
        if entry is None:
            self._spans[name] = [1, seconds, seconds]
        else:
            entry[0] += 1
            entry[1] += seconds
            entry[2] = max(entry[2], seconds)

    def mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter() - self.started

    def gpu_mark(self, name: str) -> None:
        if self._device is None:
            return
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        self._gpu.append((name, event))

    def summary(self, *, gpu: bool = True, **extra: object) -> dict[str, object]:
        """The trace as plain JSON values, times in milliseconds."""
        out: dict[str, object] = {
            **extra,
            "start_unix": self.started_unix,
            "total_ms": _ms(time.perf_counter() - self.started),
            "spans": {
                name: [int(count), _ms(total), _ms(longest)]
                for name, (count, total, longest) in self._spans.items()
            },
            "marks": {name: _ms(at) for name, at in self._marks.items()},
        }
        if gpu and self._gpu:
            first = self._gpu[0][1]
            self._gpu[-1][1].synchronize()
            marks: dict[str, list[float]] = {}
            for name, event in self._gpu:
                marks.setdefault(name, []).append(round(first.elapsed_time(event), 3))
            out["gpu_ms"] = marks
        return out

    def log(self, **extra: object) -> None:
        ok = bool(extra.get("ok", True))
        try:
            summary = self.summary(gpu=ok, **extra)
        except RuntimeError as exc:  # an event that never completed: leave the GPU part out
            log.debug("GPU marks unavailable: %s", exc)
            summary = self.summary(gpu=False, **extra)
        log.info("%s%s", PHASES_LOG_PREFIX, json.dumps(summary, separators=(",", ":")))


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


class EngineLane:
    """A round's engine calls, one at a time and in order, off the bucket pipeline's path.

    `submit` returns a task at once; its call runs after every earlier one, so the next
    bucket can be received (or filled) while the engine loads this one. The first
    failure is kept in `error` and later calls are skipped: the round keeps its
    collectives in step and fails at the vote. Tasks never raise `EngineError`.
    """

    def __init__(self, timeout_seconds: float, trace: PhaseTrace) -> None:
        self._timeout = timeout_seconds
        self._trace = trace
        self._tasks: list[asyncio.Task[None]] = []
        self.error: RoundFailed | None = None

    def submit(
        self, what: str, phase: str, call: Callable[[], Awaitable[None]]
    ) -> asyncio.Task[None]:
        previous = self._tasks[-1] if self._tasks else None
        task = asyncio.create_task(self._run(previous, what, phase, call))
        self._tasks.append(task)  # a round submits a few dozen: kept until drained
        return task

    async def _run(
        self,
        previous: asyncio.Task[None] | None,
        what: str,
        phase: str,
        call: Callable[[], Awaitable[None]],
    ) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # in order; a cancelled one is not our failure
        if self.error is not None:
            return
        started = self._trace.now()
        try:
            await asyncio.wait_for(call(), self._timeout)
        except EngineError as exc:
            self.error = RoundFailed(f"engine_{exc.reason}", f"{what}: {exc}")
        except TimeoutError:
            self.error = RoundFailed("engine_timeout", f"{what} timed out")
        self._trace.add(phase, started)

    async def wait(self, task: asyncio.Task[None], phase: str = "engine_wait") -> None:
        """Return once `task`'s call is done (its slot may be reused); time the wait."""
        if task.done():
            task.result()
            return
        started = self._trace.now()
        await task
        self._trace.add(phase, started)

    async def drain(self) -> None:
        """Wait for every submitted call."""
        for task in self._tasks:
            await task

    async def cancel(self) -> None:
        """Stop calls not yet finished (a failed round); the adapter drops what it had open."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks.clear()
