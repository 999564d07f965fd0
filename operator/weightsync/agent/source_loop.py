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
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from weightsync.agent.doorbell import SwitchNotice, doorbell_key
from weightsync.agent.engine_adapter import adapter_for
from weightsync.agent.failures import Stage
from weightsync.agent.generations import Generation, Generations
from weightsync.agent.holder import Holder
from weightsync.agent.packing import PiecePacker, SourcePacker, held_blocks, map_packer
from weightsync.agent.round_book import RoundBook
from weightsync.agent.rounds import RoundFailed, RoundOutcome
from weightsync.agent.sharded import ShardPlans, report_of
from weightsync.agent.sharded_source import ShardedSourceRound
from weightsync.agent.slot_pool import SlotPool
from weightsync.agent.source import FillChannel, SourceRound
from weightsync.api.control import DEFAULT_TRANSFER, GenerationState, LocalEngine
from weightsync.api.reasons import FailureReason
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.broadcast import TransferError
from weightsync.transfer.buffers import BucketSlots, SlotHandles, TensorSources
from weightsync.transfer.handoff import Attached, Boxes, Fenced, Publish, PublishResult
from weightsync.transfer.layout import BucketLayout, LayoutError, TensorMeta, plan_layout
from weightsync.transfer.shards import RankReport, plan_shards, staging_bound

log = logging.getLogger(__name__)

_SWITCH_NOTICE_SECONDS = 5.0  # the most a round waits to tell an old generation to switch


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
        # A Colocated plan's engine (in another pod on this GPU), its adapter, and the slot
        # epoch it attached.
        self._planned_engine: tuple[LocalEngine, EngineAdapter] | None = None
        self._engine_epoch = -1

    @property
    def fill_timeout(self) -> float:
        plan = self.generations.newest_plan()
        return (plan.transfer if plan else DEFAULT_TRANSFER).timeout_seconds

    async def close(self) -> None:
        if self._planned_engine is not None:
            await self._planned_engine[1].close()

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
            pending = hold if outcome.ok and hold is not None and not hold.done() else None
            if pending is not None:
                self._hold = _PendingHold(outcome.version, outcome.lineage, pending)
            self.book.finished(outcome, hold_pending=pending is not None)
        result = outcome.result()
        return result if pending is None else result.model_copy(update={"holding": True})

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
        generation = await self._select_generation(deadline)
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
        engine = await self._engine(generation.plan.local_engine)
        if engine is not None and self._engine_epoch != self.pool.epoch:
            try:
                await asyncio.wait_for(engine.attach_buffers(slots.slots), self.engine_timeout)
            except (EngineError, TimeoutError) as exc:
                raise RoundFailed(FailureReason.ENGINE_ATTACH_FAILED, f"attach: {exc!r}") from exc
            self._engine_epoch = self.pool.epoch
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
        if sources > 1:
            make = partial(
                ShardedSourceRound,
                report=self._report(layout, generation.plan.rank),
                plans=self.plans,
                resize=partial(self._resize, transfer.pipeline_depth),
                packer=packer if isinstance(packer, PiecePacker) else None,
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

    async def _select_generation(self, deadline: float) -> Generation:
        """The newest warm generation; older ones are told to switch, then retired.

        With none warm, waits until `deadline` for one: a plan being pre-warmed, or the
        generation the operator plans after a failed round broke the last one.
        """
        newest = self.generations.newest_usable()
        while newest is None and (left := deadline - time.monotonic()) > 0:
            async with self.generations.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.generations.changed.wait(), left)
            newest = self.generations.newest_usable()
        if newest is None:
            raise RoundFailed(
                FailureReason.NO_GROUP, "no warm group generation; waiting for a plan"
            )
        for old in self.generations.all():
            if old.number < newest.number and old.state != GenerationState.RETIRED:
                await self._switch_away(old, newest.number)
        if newest.state != GenerationState.ACTIVE:
            newest.state = GenerationState.ACTIVE
        return newest

    async def _switch_away(self, old: Generation, target: int) -> None:
        """Ring `old`'s doorbell with a switch notice (its sinks follow), then retire it."""
        group = old.group
        if group is not None:
            key = doorbell_key(old.take_seq())
            notice = SwitchNotice(generation=target).model_dump_json()
            try:
                await asyncio.wait_for(
                    group.run(lambda: group.ctl.set(key, notice)), _SWITCH_NOTICE_SECONDS
                )
            except (TimeoutError, RuntimeError) as exc:
                log.warning("could not tell generation %d to switch: %s", old.number, exc)
        old.retire()

    async def _engine(self, planned: LocalEngine | None) -> EngineAdapter | None:
        """The engine a round hands buckets to: the plan's (Colocated), else the agent's
        own, if any. A new planned engine (its pod was replaced) attaches anew."""
        if planned is None:
            return self.own_engine
        if self._planned_engine is not None:
            known, adapter = self._planned_engine
            if known == planned:
                return adapter
            await adapter.close()
        log.info("colocated engine: %s of pod %s at %s", planned.engine, planned.pod, planned.url)
        adapter = adapter_for(planned.engine, planned.url, planned.options)
        self._planned_engine = (planned, adapter)
        self._engine_epoch = -1
        return adapter
