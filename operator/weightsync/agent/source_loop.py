"""The source's half of the agent: the Publisher attaches, then each `publish` is a round.

A round enters here from the Publisher's socket (`agent.handoff_server`), chooses the
newest warm generation (telling older ones to switch), checks that the Publisher's
layout and slots still hold, attaches the Colocated engine to the slots when they
change, and runs one `SourceRound` (a `ShardedSourceRound` when the plan has several
source ranks). Its start and end go in the `RoundBook`, as a sink's do from the
`SinkLoop`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from weightsync.agent.colocated import ColocatedEngine, engine_devices, lead_engine
from weightsync.agent.direct_staging import DirectStagingRound
from weightsync.agent.failures import Stage
from weightsync.agent.generations import Generations
from weightsync.agent.holder import Holder
from weightsync.agent.packing import PiecePacker, SourcePacker, held_blocks, map_packer
from weightsync.agent.round_book import RoundBook
from weightsync.agent.rounds import RoundFailed, RoundOutcome
from weightsync.agent.sharded import ShardPlans, report_of
from weightsync.agent.sharded_source import ShardedSourceRound
from weightsync.agent.slot_pool import SlotPool
from weightsync.agent.source import FillChannel, SourceRound
from weightsync.agent.switching import select_generation
from weightsync.api.control import DEFAULT_TRANSFER
from weightsync.api.engines import MemoryTag
from weightsync.api.reasons import FailureReason
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.broadcast import TransferError
from weightsync.transfer.buffers import BucketSlots, SlotError, SlotHandles, TensorSources
from weightsync.transfer.handoff import (
    Attached,
    Boxes,
    Fenced,
    Publish,
    PublishResult,
    Released,
)
from weightsync.transfer.layout import BucketLayout, LayoutError, TensorMeta, plan_layout
from weightsync.transfer.shards import RankReport, plan_shards, staging_bound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _PendingHold:
    """An ok round's holder copy still reading the Publisher's tensors."""

    version: int
    lineage: str
    copy: asyncio.Task[None]


class SourceLoop:
    def __init__(
        self,
        generations: Generations,
        pool: SlotPool,
        holder: Holder,
        *,
        device: torch.device,
        own_engine: EngineAdapter | None,
        engine_timeout_seconds: float,
        pod: str,
        book: RoundBook,
    ) -> None:
        self.generations = generations
        self.pool = pool
        self.holder = holder
        self.device = device
        self.own_engine = own_engine
        self.engine_timeout = engine_timeout_seconds
        self.pod = pod
        self.book = book
        self.layout: BucketLayout | None = None  # the Publisher's, from its last attach
        self.boxes: Boxes | None = None  # sharded: what this rank holds, from that attach
        self.plans = ShardPlans()
        self._kept_report: tuple[BucketLayout, RankReport] | None = None
        self._lock = asyncio.Lock()  # one attach or round at a time
        self._publisher_epoch = -1  # the slot epoch the Publisher was last given
        self._packer: SourcePacker | PiecePacker | None = None  # the Publisher's tensors
        self._hold: _PendingHold | None = None
        # A Colocated plan's engine (in another pod on this GPU).
        self.colocated = ColocatedEngine(engine_timeout_seconds)

    @property
    def fill_timeout(self) -> float:
        plan = self.generations.newest_plan()
        return (plan.transfer if plan else DEFAULT_TRANSFER).timeout_seconds

    async def close(self) -> None:
        await self.colocated.close()

    def exclusive(self) -> asyncio.Lock:
        """The lock rounds and attaches hold (`local_reload` takes it too)."""
        return self._lock

    # ---------------------------------------------------------------- attach
    async def attach(
        self, metas: list[TensorMeta], sources: TensorSources | None, boxes: Boxes | None = None
    ) -> Attached:
        plan = self.generations.newest_plan()
        if plan is None:
            raise RoundFailed(FailureReason.NO_PLAN, "the agent has no membership plan yet")
        async with self._lock:
            layout = plan_layout(metas, plan.transfer.bucket_size_bytes)
            if boxes is not None and len(boxes) != len(metas):
                raise LayoutError(f"{len(boxes)} boxes for {len(metas)} tensors")
            if boxes is not None and plan.source_count == 1:
                # One source sends everything: what it holds must be every tensor, whole.
                plan_shards([report_of(layout, 0, boxes)], layout.bucket_size_bytes)
            staging = staging_bound(layout, plan.source_count)
            slots = self.pool.ensure(layout, plan.transfer.pipeline_depth, staging)
            self.layout, self.boxes = layout, boxes
            self._publisher_epoch = self.pool.epoch
            # One source packs whole buckets; with several every rank packs its own pieces
            # where the round's plan puts them (plain tensors too: a rank owning whole
            # experts). Here if the agent can map the Publisher's tensors, else there.
            sharded = plan.source_count > 1
            self._packer = None
            if sources is not None and self.device.type == "cuda" and (sharded or not boxes):
                self._packer = await asyncio.to_thread(
                    map_packer, layout, held_blocks(metas, boxes), sources, self.device, sharded
                )
            if plan.source_count == 1 or plan.rank == 0 or plan.holder:
                self.holder.prepare(layout.total_bytes)  # off the first round's path
        log.info(
            "layout %s: %d tensors, %d buckets, %d bytes, packed by the %s",
            layout.layout_hash[:12],
            len(metas),
            len(layout.buckets),
            layout.total_bytes,
            "agent" if self._packer is not None else "Publisher",
        )
        return Attached(
            layout_hash=layout.layout_hash,
            bucket_size_bytes=layout.bucket_size_bytes,
            alignment=layout.alignment,
            slots=slots.handles,
            agent_packs=self._packer is not None,
        )

    # ---------------------------------------------------------------- a round
    async def publish(self, request: Publish, channel: FillChannel) -> PublishResult:
        """One round; whatever goes wrong, the Publisher gets a result that says what."""
        async with self._lock:
            # A hold pending here was never fenced: the tensors may have been written.
            await self._settle_hold(clean=False)
            started = time.monotonic()
            hold: asyncio.Task[None] | None = None
            try:
                self._check_version(request)
                outcome, hold = await self._round(request, channel, started)
            except (RoundFailed, TransferError) as exc:
                # A TransferError here came before the round's own handling (the
                # generation it selected closed under it: `generation_closed`).
                stage = exc.stage if isinstance(exc, RoundFailed) else Stage.TRANSFER
                outcome = RoundOutcome.failed(
                    request.version,
                    None,
                    started,
                    exc.reason,
                    str(exc),
                    lineage=request.lineage,
                    member=self._member(),
                    stage=stage,
                )
            except Exception as exc:
                log.exception("round for version %d failed unexpectedly", request.version)
                outcome = RoundOutcome.failed(
                    request.version,
                    None,
                    started,
                    FailureReason.INTERNAL_ERROR,
                    repr(exc),
                    lineage=request.lineage,
                )
            outcome, hold = await self._wake_kv_cache(outcome, hold, started)
            pending = hold if outcome.ok and hold is not None and not hold.done() else None
            if pending is not None:
                self._hold = _PendingHold(outcome.version, outcome.lineage, pending)
            self.book.finished(outcome, hold_pending=pending is not None)
        result = outcome.result()
        return result if pending is None else result.model_copy(update={"holding": True})

    async def _wake_kv_cache(
        self, outcome: RoundOutcome, hold: asyncio.Task[None] | None, started: float
    ) -> tuple[RoundOutcome, asyncio.Task[None] | None]:
        """Wake a released KV cache once the round is over (the weights are in place): a
        round that succeeded but leaves the engine without it fails, saying so."""
        try:
            await self.colocated.wake(MemoryTag.KV_CACHE)
        except RoundFailed as exc:
            if not outcome.ok:  # its own failure says more; the next round wakes it
                log.warning("after the failed round for version %d: %s", outcome.version, exc)
                return outcome, hold
            if hold is not None:  # the holder's copy is not vouched for by a failed round
                await asyncio.wait({hold}, timeout=self.fill_timeout)
                self.holder.abandon()
            failed = RoundOutcome.failed(
                outcome.version,
                outcome.generation,
                started,
                exc.reason,
                f"version {outcome.version} was loaded, but {exc}",
                lineage=outcome.lineage,
                member=self._member(),
                stage=Stage.COMMIT,
            )
            return failed, None
        return outcome, hold

    async def release(self) -> Released:
        """Free the Colocated engine's memory as the newest plan says (the trainer is about
        to train); the next round wakes it."""
        plan = self.generations.newest_plan()
        async with self._lock:
            freed = await self.colocated.release(lead_engine(plan) if plan else None)
        return Released(tags=sorted(freed))

    async def fence(self, version: int, clean: bool) -> Fenced:
        """The Publisher will write the tensors of round `version`: wait for the holder's
        copy of them, and keep it as the held version if they were not written yet."""
        async with self._lock:
            if self._hold is not None and self._hold.version == version:
                held = await self._settle_hold(clean)
            else:
                held = self.holder.held_version == version
        return Fenced(version=version, held=held)

    async def publisher_left(self) -> None:
        """The Publisher's connection closed: a pending copy can no longer be vouched for."""
        async with self._lock:
            await self._settle_hold(clean=False)

    async def _settle_hold(self, clean: bool) -> bool:
        """End the pending hold: wait for its copy, commit it if `clean`; True if held."""
        pending, self._hold = self._hold, None
        if pending is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(pending.copy), self.fill_timeout)
        except TimeoutError:
            log.warning("holder: the copy of version %d did not finish", pending.version)
            clean = False
        if clean:
            return self.holder.commit(pending.version, pending.lineage)
        log.warning(
            "holder: version %d is not held: the Publisher did not fence before writing its"
            " tensors (call Publisher.fence() or guard(optimizer) before the optimizer step)",
            pending.version,
        )
        self.holder.abandon()
        return False

    def _member(self) -> str:
        """How a failure here names this rank: its rank in the newest plan."""
        plan = self.generations.newest_plan()
        return f"{self.pod} (rank {plan.rank if plan else 0}, source)"

    def _check_version(self, request: Publish) -> None:
        """Versions rise within a lineage (a Publisher); a new lineage starts anywhere."""
        last, lineage = self.book.committed()
        if request.lineage == lineage and last is not None and request.version <= last:
            raise RoundFailed(
                FailureReason.STALE_VERSION,
                f"version {request.version} is not above {last}, the last committed by this"
                " Publisher: versions must rise (a restarted trainer gets a new Publisher)",
            )

    async def _round(
        self, request: Publish, channel: FillChannel, started: float
    ) -> tuple[RoundOutcome, asyncio.Task[None] | None]:
        layout = self.layout
        if layout is None or request.layout_hash != layout.layout_hash:
            raise RoundFailed(FailureReason.LAYOUT_MISMATCH, "the tensor set changed: attach again")
        # publish() returns within the transfer timeout: waiting for a group counts too.
        deadline = started + self.fill_timeout
        generation = await select_generation(self.generations, deadline)
        transfer = generation.plan.transfer
        if transfer.bucket_size_bytes != layout.bucket_size_bytes:
            raise RoundFailed(
                FailureReason.LAYOUT_MISMATCH, "the plan changed the bucket size: attach again"
            )
        sources = generation.plan.source_count
        slots = self.pool.ensure(layout, transfer.pipeline_depth, staging_bound(layout, sources))
        if self.pool.epoch != self._publisher_epoch:
            raise RoundFailed(
                FailureReason.LAYOUT_MISMATCH, "the bucket slots changed: attach again"
            )
        planned = lead_engine(generation.plan)
        engine = await self.colocated.adapter(planned) if planned else self.own_engine
        await self.colocated.wake(MemoryTag.WEIGHTS)  # before any bucket, if released
        if planned is not None:  # every source rank's GPU holds a copy for the engine
            try:
                self.pool.use_devices(engine_devices(self.device, sources))
            except SlotError as exc:
                raise RoundFailed(FailureReason.ENGINE_ATTACH_FAILED, str(exc)) from exc
        if engine is not None and self.colocated.epoch != self.pool.engine_epoch:
            try:
                await asyncio.wait_for(self.attach_engine(engine), self.engine_timeout)
            except (EngineError, TimeoutError) as exc:
                raise RoundFailed(FailureReason.ENGINE_ATTACH_FAILED, f"attach: {exc!r}") from exc
        packer = self._packer
        if packer is not None and (sources > 1) != isinstance(packer, PiecePacker):
            raise RoundFailed(
                FailureReason.LAYOUT_MISMATCH, "the plan's source ranks changed: attach again"
            )
        group = generation.group
        whole = packer if isinstance(packer, SourcePacker) and packer.layout is layout else None
        if whole is not None and group is not None:
            channel = whole.channel(slots.slots, group.run)
        self.book.started(generation)
        # Several source ranks each see the whole version; the lead holds it (by default),
        # the others only when the plan asks.
        holds = sources == 1 or generation.plan.rank == 0 or generation.plan.holder
        holder = self.holder if holds else None
        hold_from = whole.by_name if whole is not None else None
        # Several source ranks: the same round, plus the report exchange and owners' sends.
        make: Callable[..., SourceRound] = SourceRound
        alone = generation.plan.world_size == 1  # Colocated: nobody receives the slots
        if alone and whole is not None and engine is not None and engine.stages_directly:
            make = partial(DirectStagingRound, packer=whole)  # one copy
        elif sources > 1:
            make = partial(
                ShardedSourceRound,
                report=self._report(layout, generation.plan.rank),
                plans=self.plans,
                resize=partial(self._resize, transfer.pipeline_depth),
                packer=packer if isinstance(packer, PiecePacker) else None,
                replicate=self.pool.replicate,
                attach=partial(self._attach_if_changed, engine) if engine else None,
            )
        runner = make(
            generation,
            layout,
            slots,
            request.version,
            channel,
            lineage=request.lineage,
            local_engine=engine,
            engine_timeout_seconds=self.engine_timeout,
            holder=holder,
            hold_from=hold_from,
            deadline=deadline,
        )
        return await runner.run(), runner.hold

    async def attach_engine(self, engine: EngineAdapter) -> None:
        """Attach the Colocated engine to every copy of the slots (one per engine device)."""
        await engine.attach_buffers(self.pool.engine_slots(), self.pool.copy_count)
        self.colocated.epoch = self.pool.engine_epoch

    async def _attach_if_changed(self, engine: EngineAdapter) -> None:
        if self.colocated.epoch != self.pool.engine_epoch:
            await self.attach_engine(engine)

    def _report(self, layout: BucketLayout, rank: int) -> RankReport:
        """This rank's report of what it holds, made once per attach and rank (its JSON and
        digest are what every round offers)."""
        kept = self._kept_report
        if kept is None or kept[0] is not layout or kept[1].rank != rank:
            kept = self._kept_report = (layout, report_of(layout, rank, self.boxes))
        return kept[1]

    def _resize(
        self, depth: int, layout: BucketLayout, staging: int
    ) -> tuple[BucketSlots, SlotHandles | None]:
        """A sharded round's slots, for the whole model's layout (this rank attached only
        what it publishes); their handles when they are new to the Publisher."""
        if isinstance(self._packer, PiecePacker) and not self.pool.fits(layout, depth, staging):
            self._packer.forget()  # its views would keep the old slots alive
        slots = self.pool.ensure(layout, depth, staging)
        if self.pool.epoch == self._publisher_epoch:
            return slots, None
        self._publisher_epoch = self.pool.epoch
        return slots, slots.handles
