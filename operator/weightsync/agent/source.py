"""The source side of a round: a slot is filled, the agent broadcasts it.

Bucket k is filled into slot k % depth (by the agent itself from the Publisher's shared
tensors on GPU, `agent.packing`, else by the Publisher) while bucket k-1 is still on the
wire; a slot is filled again only after its broadcast completed. In Colocated mode the
source also drives a local engine, which reads the same slots: that is the whole
transport (no peers, no broadcast). The engine loads bucket k on an `EngineLane` while
bucket k+1 is filled into the other slot; a slot is refilled only once the engine is
done with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist

from weightsync.agent.doorbell import RoundHeader, checksum_key, doorbell_key, layout_key
from weightsync.agent.engine_lane import EngineLane
from weightsync.agent.failures import SECONDHAND, Stage, root_cause
from weightsync.agent.generations import Generation
from weightsync.agent.holder import Holder
from weightsync.agent.rounds import (
    RankRound,
    RoundFailed,
    RoundOutcome,
    naming_peers,
)
from weightsync.api.reasons import FailureReason
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.broadcast import TransferError, written_checksum
from weightsync.transfer.buffers import BucketSlots, SlotHandles
from weightsync.transfer.handoff import Pieces
from weightsync.transfer.layout import Bucket, BucketLayout

log = logging.getLogger(__name__)


class FillChannel(Protocol):
    async def fill(
        self,
        bucket: int,
        slot: int,
        pieces: Pieces | None = None,
        slots: SlotHandles | None = None,
    ) -> None:
        """Have bucket `bucket` copied into slot `slot` (ordered before its broadcast), or
        only this rank's `pieces` of it (tensor name, slot offset), into `slots` when the
        agent reallocated them; raise `RoundFailed`."""


class SourceRound(RankRound):
    def __init__(
        self,
        generation: Generation,
        layout: BucketLayout,
        slots: BucketSlots,
        version: int,
        channel: FillChannel,
        *,
        lineage: str,
        local_engine: EngineAdapter | None,
        engine_timeout_seconds: float,
        holder: Holder | None = None,
        hold_from: Mapping[str, torch.Tensor] | None = None,
        deadline: float | None = None,
    ) -> None:
        super().__init__(generation, generation.take_seq(), slots.device, deadline)
        self.layout = layout
        self.slots = slots
        self.version = version
        self.lineage = lineage
        self.channel = channel
        self.local_engine = local_engine
        self.engine_timeout = engine_timeout_seconds
        self.holder = holder
        # The tensors being published, when this agent maps them: the holder copies from
        # them beside the broadcast instead of from each slot before its reuse.
        self.hold_from = hold_from
        self.hold: asyncio.Task[None] | None = None  # that copy, while it runs
        self.checksum = generation.plan.transfer.checksum
        self.lane = (
            EngineLane(engine_timeout_seconds, self.trace, self.deadline) if local_engine else None
        )
        self.begun = False  # the local engine's update was opened (an abort must close it)

    def _round_error(self) -> RoundFailed | None:
        if self.error is not None:
            return self.error
        return self.lane.error if self.lane is not None else None

    async def _announce(self, reports: list[str] | None = None) -> None:
        """Ring the doorbell: the round's header (and its layout, once per generation)."""
        ctl = self.group.ctl
        header = RoundHeader(
            seq=self.seq,
            version=self.version,
            lineage=self.lineage,
            layout_hash=self.layout.layout_hash,
            bucket_count=len(self.layout.buckets),
            checksum=self.checksum,
            reports=reports or [],
        )
        layout_hash = self.layout.layout_hash

        def announce() -> None:
            if layout_hash not in self.generation.layouts_sent:
                ctl.set(layout_key(layout_hash), self.layout.to_json())
            ctl.set(doorbell_key(self.seq), header.model_dump_json())

        started = self.trace.now()
        await self.group.run(announce)
        self.trace.add("announce", started)
        self.generation.layouts_sent.add(layout_hash)

    async def _fill(self, bucket: Bucket, slot_index: int) -> None:
        """The Publisher packs `bucket` into the slot; a failure fails the round softly."""
        if self._round_error() is not None:
            return
        started = self.trace.now()
        try:
            await self.channel.fill(bucket.index, slot_index)
        except RoundFailed as exc:
            self.error = exc
        self.trace.add("fill", started)

    async def _first_fill(self, bucket: Bucket) -> None:
        """Ring the doorbell while the Publisher packs bucket 0: sinks wake meanwhile."""
        results = await asyncio.gather(
            self._announce(), self._fill(bucket, 0), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _stream(self) -> list[int]:
        transport, slots, lane = self.group.transport, self.slots.slots, self.lane
        depth = len(slots)
        sends: deque[dist.Work | None] = deque()
        loads: deque[asyncio.Task[None] | None] = deque()
        checksums: list[int] = []
        for bucket in self.layout.buckets:
            slot_index = bucket.index % depth
            if len(sends) == depth:  # the slot's previous bucket must be off the wire...
                await self._wait_sent([sends.popleft()], "slot_wait")
                load = loads.popleft()
                if lane is not None and load is not None:  # ...and out of the engine's hands
                    await lane.wait(load)
            if bucket.index == 0:
                await self._first_fill(bucket)
                self.trace.gpu_mark("first_issue")
            else:
                await self._fill(bucket, slot_index)
            view = slots[slot_index][: bucket.nbytes]
            load = None
            if lane is not None and self.local_engine is not None and self.error is None:
                call = partial(self.local_engine.load_bucket, slot_index, bucket.tensors)
                load = lane.submit(f"load bucket {bucket.index}", "engine_load", call)
            loads.append(load)
            if self.checksum:
                checksums.append(await self.group.run(partial(written_checksum, view, bucket)))
            started = self.trace.now()
            sends.append(await self.group.run(partial(transport.start_bucket, view)))
            self.trace.add("issue", started)
            if self.holder is not None and self.hold_from is None:  # for P2P recovery
                await self.holder.stage(self.version, self.layout, bucket, view, depth)
        while sends:
            await self._wait_sent([sends.popleft()], "drain")
        if lane is not None:
            started = self.trace.now()
            await lane.drain()
            self.trace.add("engine_drain", started)
        self.trace.mark("streamed")
        return checksums

    async def _wait_sent(self, works: list[dist.Work | None], phase: str) -> None:
        """Wait for all of a bucket's sends, in one hop to the collective thread."""
        if all(w is None for w in works):
            return
        started = self.trace.now()
        wait = partial(
            self.group.transport.wait_all,
            works,
            deadline=self._deadline(),
            failure_key=self.failure_key,
        )
        await self.group.run(wait)
        self.trace.add(phase, started)
        self.trace.gpu_mark("sent")

    def _votes_ahead(self) -> AbstractContextManager[None]:
        """The holder's copy of the Publisher's tensors pauses while the round votes: the
        votes' flag reads must not queue behind it on the copy engine (`VoteGate`)."""
        if self.hold is None or self.holder is None:
            return nullcontext()
        return self.holder.votes.voting()

    def _begin_local(self) -> None:
        """Open the local engine's update, on its lane ahead of the first load."""
        engine, lane = self.local_engine, self.lane
        if engine is not None and lane is not None:
            self.begun = True
            lane.submit("begin", "engine_begin", lambda: engine.begin_update(self.version))

    async def _commit_local(self) -> None:
        engine, lane = self.local_engine, self.lane
        if engine is None or lane is None:
            return
        await lane.submit("finish", "engine_finish", lambda: engine.finish_update(self.version))

    async def run(self) -> RoundOutcome:
        """The round; with `hold_from`, the holder's copy runs beside it (`self.hold`).
        An ok round returns without waiting for that copy (the Publisher fences before
        it writes its tensors: `SourceLoop.fence`); a failed one waits for it, since the
        Publisher may write its tensors as soon as it hears."""
        if self.holder is not None and self.hold_from is not None:
            copy = self.holder.stage_tensors(self.version, self.layout, self.hold_from)
            self.hold = asyncio.create_task(copy, name=f"hold-v{self.version}")
        try:
            outcome = await self._run()
        except BaseException:
            if self.hold is not None:
                await self.hold
            raise
        if self.hold is not None and not outcome.ok:
            await self.hold
        return outcome

    async def _run(self) -> RoundOutcome:
        started = time.monotonic()
        number = self.generation.number
        try:
            self._begin_local()
            checksums = await self._stream()
            if self.checksum and self.me.rank == 0:
                payload = json.dumps(checksums)
                await self.group.run(lambda: self.group.ctl.set(checksum_key(self.seq), payload))
            with self._votes_ahead():
                if await self._vote(int(self._round_error() is not None), "vote_transfer"):
                    raise self._round_error() or RoundFailed(
                        FailureReason.PEER_ERROR, "a sink failed the round", Stage.TRANSFER
                    )
                await self._commit_local()
                if await self._vote(int(self._round_error() is not None), "vote_commit"):
                    raise self._round_error() or RoundFailed(
                        FailureReason.COMMIT_FAILED, "a sink's engine did not commit", Stage.COMMIT
                    )
        except (TransferError, dist.DistError) as exc:
            # This rank's own failure (its engine's), if it had one, is what it reports.
            failure = self._round_error() or self._transfer_failure(exc)
            await self._fail_hard(failure)
            return await self._failed(started, failure)
        except RoundFailed as exc:
            await self._abort_local(exc.reason)
            return await self._failed(started, exc)
        self.trace.log(
            seq=self.seq,
            version=self.version,
            role="source",
            ok=True,
            buckets=len(self.layout.buckets),
            bytes=self.layout.total_bytes,
        )
        return RoundOutcome(
            version=self.version,
            generation=number,
            ok=True,
            duration_seconds=time.monotonic() - started,
            nbytes=self.layout.total_bytes,
            finished_at=time.time(),
            lineage=self.lineage,
        )

    async def _failed(self, started: float, failure: RoundFailed) -> RoundOutcome:
        """The round's failure, put down to the member that caused it (the notes)."""
        self.trace.log(seq=self.seq, version=self.version, role="source", ok=False)
        plan = self.generation.plan
        # Every sink but one lost member will say something when the transport broke.
        hard = failure.reason in SECONDHAND or failure.stage in (Stage.TRANSFER, Stage.TIMEOUT)
        notes = await self._read_notes(expect=plan.world_size - 2 if hard else 0)
        if all(n.rank != plan.rank for n in notes):
            notes.append(self._note(failure))
        cause = root_cause(notes, plan.members, plan.rank) or self._note(failure)
        if "; peer: " not in cause.message:
            # A sink's plan has no roster (`MembershipPlan`): the peer behind an address
            # in its note is named here, where the roster is.
            message = naming_peers(cause.message, plan.members, cause.rank)
            cause = cause.model_copy(update={"message": message})
        return RoundOutcome.blamed(
            self.version, self.generation.number, started, cause, lineage=self.lineage
        )

    async def _abort_local(self, reason: str) -> None:
        if self.local_engine is None or not self.begun:
            return
        if self.lane is not None:
            await self.lane.cancel()  # the engine takes one call at a time
        try:
            await asyncio.wait_for(
                self.local_engine.abort_update(self.version, reason),
                min(self.engine_timeout, self.grace()),
            )
        except (EngineError, TimeoutError) as exc:
            log.warning("local engine abort failed: %s", exc)

    async def _fail_hard(self, failure: RoundFailed) -> None:
        """Tell the peers (failure key), abort the communicator, drop the local update."""
        await self._flag_failure(self.version, "source", failure)
        await self._abort_local(failure.reason)
