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

from weightsync.agent.failures import (
    SECONDHAND,
    FailureNote,
    Stage,
    note_key,
    parse_note,
    parse_ranks,
    ranks_key,
)
from weightsync.agent.generations import Generation
from weightsync.api.control import PlanMember
from weightsync.engines.base import EngineError
from weightsync.transfer.broadcast import TransferError
from weightsync.transfer.buffers import BucketSlots
from weightsync.transfer.layout import BucketLayout

log = logging.getLogger(__name__)

PHASES_LOG_PREFIX = "round phases "
# How long a failing rank spends telling its peers and its engine, past the deadline at
# worst: a peer or engine that does not answer in this time is not waited for.
FAILURE_GRACE_SECONDS = 1.0
NOTES_WAIT_SECONDS = 5.0  # the most the source waits for the failing ranks' accounts


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
    lineage: str  # the Publisher's: a trainer restarted from an earlier step starts anew
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
    """A round failed on this rank; `reason` is a metric label, `stage` where it failed."""

    def __init__(self, reason: str, message: str, stage: Stage = Stage.PREPARE) -> None:
        super().__init__(message)
        self.reason = reason
        self.stage = stage


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
    lineage: str = ""
    member: str = ""  # the member the failure is put down to ("pod (rank r, role)")
    stage: str = ""

    @classmethod
    def failed(
        cls,
        version: int,
        generation: int | None,
        started: float,
        reason: str,
        message: str,
        *,
        lineage: str = "",
        member: str = "",
        stage: str = "",
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
            lineage=lineage,
            member=member,
            stage=stage,
        )

    @classmethod
    def blamed(
        cls,
        version: int,
        generation: int | None,
        started: float,
        cause: FailureNote,
        *,
        lineage: str = "",
    ) -> RoundOutcome:
        """A failure put down to `cause`, the note of the member that caused it."""
        return cls.failed(
            version,
            generation,
            started,
            cause.reason,
            cause.describe(),
            lineage=lineage,
            member=f"{cause.pod} (rank {cause.rank}, {cause.role})",
            stage=cause.stage.value,
        )


class RankRound:
    """What the source's and a sink's side of one round share: the generation's group,
    the round's failure key and deadline, the phase trace, the votes, and how a broken
    transport fails the round on this rank (flag the peers, break the generation)."""

    def __init__(
        self,
        generation: Generation,
        seq: int,
        device: torch.device,
        deadline: float | None = None,
    ) -> None:
        if generation.group is None:
            raise RoundFailed("no_group", f"generation {generation.number} is not formed")
        self.generation = generation
        self.group = generation.group
        self.seq = seq
        self.timeout = generation.plan.transfer.timeout_seconds
        # One deadline for the whole round, on every rank: every wait, vote and engine
        # call is bounded by what is left of it, so a round ends within `timeout`
        # (plus the short grace of its failure path) whatever a peer does.
        self.deadline = time.monotonic() + self.timeout if deadline is None else deadline
        self.failure_key = failure_key(seq)
        self.error: RoundFailed | None = None  # a soft failure: the round runs on, then fails
        self.trace = PhaseTrace(device)

    def _deadline(self) -> float:
        return self.deadline

    def remaining(self) -> float:
        """Seconds left before the round's deadline (never negative)."""
        return max(0.0, self.deadline - time.monotonic())

    @property
    def me(self) -> PlanMember:
        return self.generation.plan.me

    def _note(self, failure: RoundFailed) -> FailureNote:
        me = self.me
        return FailureNote(
            rank=me.rank,
            pod=me.pod,
            role=me.role.value,
            stage=failure.stage,
            reason=failure.reason,
            message=str(failure),
        )

    async def _write_note(self, failure: RoundFailed) -> None:
        """Leave this rank's account where the source reads it (bounded: best effort)."""
        note = self._note(failure).model_dump_json()
        ctl, rank, seq = self.group.ctl, self.me.rank, self.seq

        def write() -> None:
            ctl.set(note_key(seq, rank), note)
            ctl.append(ranks_key(seq), f"{rank},")  # type: ignore[attr-defined]  # not in stubs

        try:
            await asyncio.wait_for(self.group.run(write), FAILURE_GRACE_SECONDS)
        except (TimeoutError, dist.DistError, RuntimeError) as exc:
            log.warning("could not leave a failure note: %s", exc)

    async def _read_notes(self, expect: int) -> list[FailureNote]:
        """The notes failing ranks left for this round. Waits until every other rank wrote
        one, or `expect` of them did and one says it failed on its own account (or a grace
        passed since: a dead member writes nothing), or the wait is over. The peers see a
        broken transport when this rank does, and take a moment to say so."""
        ctl, seq, me = self.group.ctl, self.seq, self.me.rank
        others = self.generation.plan.world_size - 1
        # Up to the grace past the deadline; a round that failed early waits a little more
        # for slow peers, never past what it would have taken anyway.
        wait = min(max(self.remaining(), 0.0) + FAILURE_GRACE_SECONDS, NOTES_WAIT_SECONDS)
        until = time.monotonic() + wait

        def read() -> list[FailureNote]:
            notes: dict[int, FailureNote] = {}
            enough_at: float | None = None
            while True:
                if ctl.check([ranks_key(seq)]):
                    for rank in parse_ranks(ctl.get(ranks_key(seq))):
                        if rank not in notes:
                            note = parse_note(ctl.get(note_key(seq, rank)))
                            if note is not None:
                                notes[rank] = note
                heard = [n for r, n in notes.items() if r != me]
                now = time.monotonic()
                if len(heard) >= expect and enough_at is None:
                    enough_at = now
                firsthand = any(n.reason not in SECONDHAND for n in heard)
                if (
                    len(heard) >= others
                    or (enough_at is not None and (firsthand or now - enough_at > 1.0))
                    or now > until
                ):
                    return list(notes.values())
                time.sleep(0.02)

        try:
            return await asyncio.wait_for(self.group.run(read), wait + 0.5)
        except (TimeoutError, dist.DistError, RuntimeError) as exc:
            log.warning("could not read the failure notes: %s", exc)
            return []

    async def _vote(self, flag: int, phase: str) -> int:
        """The fail-together vote: the maximum of `flag` over every rank."""
        error = self._round_error()
        if flag and error is not None:
            await self._write_note(error)
        transport, deadline = self.group.transport, self._deadline()
        started = self.trace.now()
        agreed = await self.group.run(
            lambda: transport.agree_max(flag, deadline=deadline, failure_key=self.failure_key)
        )
        self.trace.add(phase, started)
        return agreed

    def _round_error(self) -> RoundFailed | None:
        """This rank's own failure so far (a soft one: the round runs on, then fails)."""
        return self.error

    def _transfer_failure(self, exc: Exception) -> RoundFailed:
        """A transport or store failure as this rank's failure, naming the peer it lost."""
        reason = exc.reason if isinstance(exc, TransferError) else "store_error"
        plan = self.generation.plan
        stage = Stage.TIMEOUT if reason == "timeout" else Stage.TRANSFER
        return RoundFailed(reason, naming_peers(str(exc), plan.members, plan.rank), stage)

    async def _flag_failure(self, version: int, label: str, failure: RoundFailed) -> None:
        """Leave a note, tell the peers (failure key, `label`), and break this generation."""
        reason, message = failure.reason, str(failure)
        log.warning("round %d (version %d) failed: %s", self.seq, version, message)
        await self._write_note(failure)

        def flag() -> None:
            try:
                self.group.ctl.set(self.failure_key, f"{label}: {reason}")
            except dist.DistError as exc:
                log.warning("could not set the failure key: %s", exc)

        try:
            await asyncio.wait_for(self.group.run(flag), FAILURE_GRACE_SECONDS)
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

    def __init__(self, timeout_seconds: float, trace: PhaseTrace, deadline: float) -> None:
        self._timeout = timeout_seconds
        self._deadline = deadline  # the round's: no call outlives it
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
        budget = min(self._timeout, max(0.0, self._deadline - time.monotonic()))
        stage = Stage.COMMIT if phase == "engine_finish" else Stage.ENGINE_LOAD
        try:
            await asyncio.wait_for(call(), budget)
        except EngineError as exc:
            self.error = RoundFailed(f"engine_{exc.reason}", f"{what}: {exc}", stage)
        except TimeoutError:
            message = f"{what}: no answer in {budget:.1f} s"
            self.error = RoundFailed("engine_timeout", message, stage)
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
