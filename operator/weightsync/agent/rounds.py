"""What source and sink rounds share: a rank's round, its failure and its outcome.

The doorbell that starts a round and the store keys are in `agent.doorbell`; where a
round's time goes in `agent.trace`; the engine calls beside the pipeline in
`agent.engine_lane`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weightsync.agent.doorbell import failure_key
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
from weightsync.agent.trace import PhaseTrace
from weightsync.api.control import PlanMember, RoundReport
from weightsync.api.reasons import FailureReason
from weightsync.transfer.broadcast import TransferError
from weightsync.transfer.handoff import PublishResult

log = logging.getLogger(__name__)

# What a round keeps of its timeout for its failure path (telling its peers and its
# engine, reading their notes): its work must be done by the timeout less this, so that
# a failed round, too, ends within its timeout. A quarter of a shorter timeout.
FAILURE_GRACE_SECONDS = 1.0
# The least a failure step gets when the round's end has come (a store write takes ms).
_LAST_STEP_SECONDS = 0.02
NOTES_WAIT_SECONDS = 5.0  # the most the source waits for the failing ranks' accounts


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
    stage: Stage | None = None  # where it failed; None when it did not

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
        stage: Stage | None = None,
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
            stage=cause.stage,
        )

    @property
    def stage_label(self) -> str:
        """The stage as the wire and the metrics name it: "" when it did not fail."""
        return "" if self.stage is None else self.stage.value

    def result(self) -> PublishResult:
        """What the Publisher is answered."""
        return PublishResult(
            version=self.version,
            ok=self.ok,
            duration_seconds=self.duration_seconds,
            bytes=self.nbytes,
            reason=self.reason,
            message=self.message,
            generation=self.generation,
            member=self.member,
            stage=self.stage_label,
        )

    def report(self) -> RoundReport:
        """What the operator reads in the agent's status."""
        duration = max(self.duration_seconds, 1e-9)
        return RoundReport(
            version=self.version,
            generation=self.generation,
            ok=self.ok,
            duration_millis=round(self.duration_seconds * 1000),
            bytes=self.nbytes,
            bandwidth_bytes_per_second=int(self.nbytes / duration) if self.ok else 0,
            reason=self.reason,
            message=self.message,
            finished_at_unix_millis=int(self.finished_at * 1000),
            lineage=self.lineage,
            member=self.member,
            stage=self.stage_label,
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
            raise RoundFailed(
                FailureReason.NO_GROUP, f"generation {generation.number} is not formed"
            )
        self.generation = generation
        self.group = generation.group
        self.seq = seq
        self.timeout = generation.plan.transfer.timeout_seconds
        # The round ends by `end`, on every rank, whatever a peer does: every wait, vote
        # and engine call is bounded by `deadline`, the end less the failure path's
        # grace, and each step of that path by what is left until `end`.
        self.end = time.monotonic() + self.timeout if deadline is None else deadline
        self.deadline = self.end - min(FAILURE_GRACE_SECONDS, self.timeout / 4)
        self.failure_key = failure_key(seq)
        self.error: RoundFailed | None = None  # a soft failure: the round runs on, then fails
        self.trace = PhaseTrace(device)

    def _deadline(self) -> float:
        return self.deadline

    def remaining(self) -> float:
        """Seconds left before the round's deadline (never negative)."""
        return max(0.0, self.deadline - time.monotonic())

    def grace(self) -> float:
        """What a step of the failure path may take: what is left until the round's end."""
        return max(_LAST_STEP_SECONDS, self.end - time.monotonic())

    @property
    def me(self) -> PlanMember:
        return self.generation.plan.me

    def _note(self, failure: RoundFailed) -> FailureNote:
        me = self.me
        return FailureNote(
            rank=me.rank,
            pod=me.pod,
            role=me.role.label,
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
            await asyncio.wait_for(self.group.run(write), self.grace())
        except (TimeoutError, dist.DistError, RuntimeError) as exc:
            log.warning("could not leave a failure note: %s", exc)

    async def _read_notes(self, expect: int) -> list[FailureNote]:
        """The notes failing ranks left for this round. Waits until every other rank wrote
        one, or `expect` of them did and one says it failed on its own account (or a grace
        passed since: a dead member writes nothing), or the wait is over. The peers see a
        broken transport when this rank does, and take a moment to say so."""
        ctl, seq, me = self.group.ctl, self.seq, self.me.rank
        others = self.generation.plan.world_size - 1
        # Up to the round's end; a round that failed early waits a little for slow peers,
        # never past what it would have taken anyway.
        wait = min(self.grace(), NOTES_WAIT_SECONDS)
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
            return await asyncio.wait_for(self.group.run(read), wait + _LAST_STEP_SECONDS)
        except (TimeoutError, dist.DistError, RuntimeError) as exc:
            log.warning("could not read the failure notes: %s", exc)
            return []

    async def _vote(self, flag: int, phase: str) -> int:
        """The fail-together vote: the maximum of `flag` over every rank."""
        error = self._round_error()
        if flag and error is not None:
            await self._write_note(error)
        if self.generation.plan.world_size == 1:  # Colocated, one rank: nobody else votes
            return flag
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
        reason = exc.reason if isinstance(exc, TransferError) else FailureReason.STORE_ERROR
        plan = self.generation.plan
        stage = Stage.TIMEOUT if reason == FailureReason.TIMEOUT else Stage.TRANSFER
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
            await asyncio.wait_for(self.group.run(flag), self.grace())
        except TimeoutError:
            log.warning("setting the failure key timed out")
        self.generation.mark_broken(f"round {self.seq} failed: {reason}")
