"""A round with several source ranks: the source side of `agent.sharded`'s protocol.

Each source rank offers the report of what its trainer rank holds; the lead (rank 0)
plans the round from every rank's report and rings the doorbell; the others follow its
header. Each bucket then travels as one broadcast per segment from the rank that owns
it, and every source rank assembles the full bucket in its own slots (the lead's
checksums and the holders read it there). A Colocated lead then loads its engine from
them (copied to each of the engine's devices first), before the slot is reused.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from functools import partial

import torch
import torch.distributed as dist

from weightsync.agent.failures import Stage
from weightsync.agent.generations import Generation
from weightsync.agent.holder import Holder
from weightsync.agent.packing import PiecePacker
from weightsync.agent.rounds import RoundFailed
from weightsync.agent.sharded import ShardPlans, follow_header, gather_reports, offer_report
from weightsync.agent.slot_pool import Replica
from weightsync.agent.source import FillChannel, SourceRound
from weightsync.api.reasons import FailureReason
from weightsync.engines.base import EngineAdapter
from weightsync.transfer.assembly import SlotRoutes
from weightsync.transfer.broadcast import TransferError, written_checksum
from weightsync.transfer.buffers import BucketSlots, SlotHandles
from weightsync.transfer.layout import Bucket, BucketLayout
from weightsync.transfer.shards import RankReport, ShardPlan, staging_bound

# The slots for the round's layout and staging bytes, and their new handles when they
# had to be reallocated (the Publisher maps them).
Resize = Callable[[BucketLayout, int], tuple[BucketSlots, SlotHandles | None]]
# Copies a slot's first bytes to the local engine's other devices (`SlotPool.replicate`).
Replicate = Callable[[int, int], Replica]


class ShardedSourceRound(SourceRound):
    def __init__(
        self,
        generation: Generation,
        layout: BucketLayout,
        slots: BucketSlots,
        version: int,
        channel: FillChannel,
        *,
        report: RankReport,
        plans: ShardPlans,
        resize: Resize | None,
        lineage: str,
        local_engine: EngineAdapter | None,
        engine_timeout_seconds: float,
        holder: Holder | None = None,
        hold_from: Mapping[str, torch.Tensor] | None = None,
        deadline: float | None = None,
        packer: PiecePacker | None = None,
        replicate: Replicate | None = None,
        attach: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(
            generation,
            layout,
            slots,
            version,
            channel,
            lineage=lineage,
            local_engine=local_engine,
            engine_timeout_seconds=engine_timeout_seconds,
            holder=holder,
            hold_from=hold_from,
            deadline=deadline,
        )
        self.report = report  # what this rank holds
        self.plans = plans  # where the round's plan is made, once per set of reports
        self.resize = resize
        self.packer = packer  # this rank's blocks mapped here: the agent packs its pieces
        self.replicate = replicate  # copies a slot to the local engine's other devices
        self.attach = attach  # attaches the local engine to the slots again if they changed

    async def _start_sharded(self, report: RankReport) -> ShardPlan:
        """Offer this rank's report; the lead gathers every rank's, plans, and rings the
        doorbell; the others follow its header. The round's plan, the same on every rank,
        and its layout (the whole model's) becomes this round's."""
        group, seq, transfer = self.group, self.seq, self.generation.plan.transfer
        await offer_report(group, seq, report, self.generation.reports_sent)
        started = self.trace.now()
        if self.me.rank == 0:
            digests, missing = await gather_reports(
                group, self.generation.plan, seq, self.deadline, self.failure_key
            )
            if missing is not None:
                # Rung anyway (the round is flagged failed by then): the sinks take this
                # round's number and stay in step. Secondhand here: the note in the missing
                # rank's name says who.
                await self._announce(digests)
                raise RoundFailed(FailureReason.TIMEOUT, missing.describe(), Stage.TIMEOUT)
            try:
                plan = await self.plans.get(group, digests, transfer.bucket_size_bytes)
            except RoundFailed:
                # Rung anyway, as for a missing rank: every member takes this round's
                # number and fails it planning the same reports, then follows the next
                # generation's switch notice instead of waiting on an unrung doorbell.
                await self._announce(digests)
                raise
            self.layout = plan.layout
            await self._announce(digests)
        else:
            # The lead rings by the deadline, a missing rank or not: wait until the end.
            until = self.end
            header = await follow_header(group, self.generation.plan, seq, until, self.failure_key)
            if "" in header.reports:  # secondhand: the lead wrote the missing rank's note
                raise RoundFailed(
                    FailureReason.PEER_FAILED, "a source rank did not publish this round"
                )
            if header.version != self.version:
                raise RoundFailed(
                    FailureReason.SOURCES_DISAGREE,
                    f"source rank 0 publishes version {header.version}, this rank"
                    f" {self.version}: every source rank publishes the same step",
                )
            if len(header.reports) <= self.me.rank or header.reports[self.me.rank] != report.digest:
                raise RoundFailed(
                    FailureReason.SOURCES_DISAGREE, "the round's header lacks this rank's report"
                )
            plan = await self.plans.get(
                group, header.reports, transfer.bucket_size_bytes, header.layout_hash
            )
            self.layout = plan.layout
        self.trace.add("reports", started)
        return plan

    async def _stream(self) -> list[int]:
        """The buckets of a round with several source ranks: each bucket is a few
        broadcasts, one per segment from its owner; this rank fills its own pieces first.
        Every source rank assembles the full bucket too (the lead's checksums, holders)."""
        try:
            plan = await self._start_sharded(self.report)
        except RoundFailed as exc:
            # Before any collective: the other ranks cannot go on without this one, and
            # wait on the round's failure key. Fail it hard (this rank's note, the key).
            self.error = exc
            raise TransferError(exc.reason, str(exc)) from exc
        new_handles = None
        if self.resize is not None:
            staging = staging_bound(self.layout, self.generation.plan.source_count)
            self.slots, new_handles = self.resize(self.layout, staging)
        if self.packer is not None:
            self.channel = self.packer.channel(self.slots.slots, self.group.run)
        if self.lane is not None:  # a Colocated lead: its engine reads the slots resized
            if self.attach is not None:
                self.lane.submit("attach", "engine_attach", self.attach)
            super()._begin_local()
        routes = self.plans.routes(plan, self.slots.slots)
        transport, depth, rank = self.group.transport, len(self.slots.slots), self.me.rank
        pending: deque[tuple[Bucket, list[dist.Work | None]]] = deque()
        checksums: list[int] = []
        loads: dict[int, asyncio.Task[None]] = {}  # slot -> the engine's load reading it
        for bucket in self.layout.buckets:
            slot_index = bucket.index % depth
            if len(pending) == depth:
                await self._complete(routes, *pending.popleft(), checksums, loads)
            if self.lane is not None and slot_index in loads:  # the engine reads it yet
                await self.lane.wait(loads.pop(slot_index))
            pieces = routes.fill_offsets(bucket.index, rank)
            if pieces and self._round_error() is None:
                started = self.trace.now()
                try:
                    await self.channel.fill(bucket.index, slot_index, pieces, new_handles)
                    new_handles = None
                except RoundFailed as exc:
                    self.error = exc
                self.trace.add("fill", started)
            started = self.trace.now()
            sends = routes.sends(bucket.index, slot_index)
            works = await self.group.run(partial(transport.start_sends, sends))
            self.trace.add("issue", started)
            pending.append((bucket, works))
        while pending:
            await self._complete(routes, *pending.popleft(), checksums, loads)
        if self.lane is not None:
            started = self.trace.now()
            await self.lane.drain()
            self.trace.add("engine_drain", started)
        self.trace.mark("streamed")
        return checksums

    async def _complete(
        self,
        routes: SlotRoutes,
        bucket: Bucket,
        works: list[dist.Work | None],
        checksums: list[int],
        loads: dict[int, asyncio.Task[None]],
    ) -> None:
        """A bucket's broadcasts are done: place its staged pieces, checksum it (the lead),
        hold it, and have a Colocated lead's engine load it (`loads`, by slot)."""
        await self._wait_sent(works, "slot_wait")
        depth = len(self.slots.slots)
        slot_index = bucket.index % depth
        if routes.staged:
            await self.group.run(partial(routes.place, bucket.index, slot_index))
        view = self.slots.slots[slot_index][: bucket.nbytes]
        if self.checksum and self.me.rank == 0:
            checksums.append(await self.group.run(partial(written_checksum, view, bucket)))
        if self.holder is not None:
            await self.holder.stage(self.version, self.layout, bucket, view, depth)
        if self.lane is not None and self._round_error() is None:  # a Colocated lead
            load = partial(self._load_engine, slot_index, bucket)
            loads[slot_index] = self.lane.submit(f"load bucket {bucket.index}", "engine_load", load)

    def _begin_local(self) -> None:
        """Not before the round's plan: the slots may be resized for it (`_stream`)."""

    async def _load_engine(self, slot: int, bucket: Bucket) -> None:
        """The local engine loads an assembled bucket from every copy of its slot."""
        engine = self.local_engine
        if engine is None:
            return
        if self.replicate is not None:
            started = self.trace.now()
            await self.replicate(slot, bucket.nbytes).wait()
            self.trace.add("replica_wait", started)
        await engine.load_bucket(slot, bucket.tensors)
