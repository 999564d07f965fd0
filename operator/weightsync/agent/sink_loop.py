"""The sink's half of the agent: follow the doorbell of its generation, round after round.

Each round header is checked and prepared here (the layout, fetched once per hash; for
several source ranks the plan of their shards, `agent.sharded`; the slots; the engine
attachment, again when its process restarted), then run by a `SinkRound`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

import torch.distributed as dist

from weightsync.agent.doorbell import (
    DOORBELL,
    Doorbell,
    RoundHeader,
    SwitchNotice,
    doorbell_key,
    failure_key,
    layout_key,
)
from weightsync.agent.failures import Stage
from weightsync.agent.generations import Generation, Generations
from weightsync.agent.holder import Holder
from weightsync.agent.round_book import RoundBook
from weightsync.agent.rounds import RoundFailed, RoundOutcome
from weightsync.agent.sharded import ShardPlans
from weightsync.agent.sink import SinkRound
from weightsync.agent.slot_pool import SlotPool
from weightsync.api.control import GenerationState
from weightsync.api.reasons import FailureReason
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.buffers import SlotError
from weightsync.transfer.layout import DEFAULT_ALIGNMENT, BucketLayout, LayoutError, align_up
from weightsync.transfer.shards import staging_bound

log = logging.getLogger(__name__)

_DOORBELL_SLICE = timedelta(seconds=10)
_HEALTH_SECONDS = 1.0  # the pre-round check of which engine process answers


class SinkLoop:
    """Follows the doorbell of the generation this sink is in, round after round."""

    def __init__(
        self,
        generations: Generations,
        pool: SlotPool,
        adapter: EngineAdapter,
        *,
        engine_timeout_seconds: float,
        holder: Holder | None = None,
        book: RoundBook,
        before_round: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.generations = generations
        self.pool = pool
        self.adapter = adapter
        self.engine_timeout = engine_timeout_seconds
        self.holder = holder
        self.before_round = before_round  # a recovery in flight gives way to the round
        self.book = book
        self._layouts: dict[str, BucketLayout] = {}
        self._plans = ShardPlans()
        self._attached_epoch = -1
        self._readied = -1  # the generation `_ready` last ran for

    async def run_forever(self) -> None:
        while True:
            generation = self.generations.oldest_listenable()
            if generation is None:
                async with self.generations.changed:
                    await self.generations.changed.wait()
                continue
            if generation.number != self._readied:
                self._readied = generation.number
                await self._ready(generation)
            bell = await self._wait_doorbell(generation)
            if bell is None:
                continue
            generation.take_seq()
            if isinstance(bell, SwitchNotice):
                log.info("switching from generation %d to %d", generation.number, bell.generation)
                generation.retire()
                continue
            await self._round(generation, bell)

    async def _ready(self, generation: Generation) -> None:
        """Before a generation's first round: slots of its bucket size, attached to the
        engine, so the engine maps them off the first round's path. A layout that needs
        more (a tensor over the bucket size; several source ranks' staging) reallocates
        in its round, which attaches again; so does a failure here."""
        transfer = generation.plan.transfer
        if generation.plan.source_count > 1 or not generation.usable:
            return
        try:
            capacity = align_up(transfer.bucket_size_bytes, DEFAULT_ALIGNMENT)
            self.pool.reserve(capacity, transfer.pipeline_depth)
            if self.pool.epoch != self._attached_epoch:
                await asyncio.wait_for(
                    self.adapter.attach_buffers(self.pool.engine_slots(), self.pool.copy_count),
                    self.engine_timeout,
                )
                self._attached_epoch = self.pool.epoch
        except (SlotError, EngineError, TimeoutError, ValueError) as exc:
            log.info("slots not attached before the first round (the round will): %s", exc)

    async def _wait_doorbell(self, generation: Generation) -> Doorbell | None:
        group = generation.group
        if group is None:
            return None
        try:
            raw = await group.wait_key(doorbell_key(generation.next_seq), _DOORBELL_SLICE)
        except (dist.DistError, RuntimeError) as exc:  # store gone, or group closed
            if generation.state != GenerationState.RETIRED:
                log.warning("generation %d doorbell lost: %s", generation.number, exc)
                generation.mark_broken(f"doorbell lost: {exc}")
                generation.retire()
            return None
        return None if raw is None else DOORBELL.validate_json(raw)

    async def _layout(self, generation: Generation, layout_hash: str) -> BucketLayout:
        layout = self._layouts.get(layout_hash)
        if layout is None:
            group = generation.group
            if group is None:
                raise RoundFailed(FailureReason.NO_GROUP, "generation not formed")
            raw = await group.run(lambda: group.ctl.get(layout_key(layout_hash)))
            layout = BucketLayout.from_json(raw)
            self._layouts[layout_hash] = layout
        return layout

    async def _prepare(self, generation: Generation, header: RoundHeader) -> SinkRound:
        """The layout (fetched once per hash), slots and engine attachment for a round."""
        if not generation.usable:
            raise RoundFailed(
                FailureReason.GROUP_BROKEN, f"generation {generation.number} is broken"
            )
        if "" in header.reports:  # the lead rang a round a source rank never joined
            raise RoundFailed(
                FailureReason.SOURCE_MISSING, "a source rank did not publish this round"
            )
        layout = await self._layout(generation, header.layout_hash)
        if len(layout.buckets) != header.bucket_count:
            raise LayoutError("bucket count disagrees with the layout")
        shards = None
        if header.reports:
            group = generation.group
            if group is None:
                raise RoundFailed(FailureReason.NO_GROUP, "generation not formed")
            bucket_size = generation.plan.transfer.bucket_size_bytes
            shards = await self._plans.get(group, header.reports, bucket_size, header.layout_hash)
        runner = SinkRound(
            generation,
            header,
            layout,
            self.pool,
            self.adapter,
            engine_timeout_seconds=self.engine_timeout,
            holder=self.holder,
            shards=shards,
            plans=self._plans,
        )
        try:
            depth = generation.plan.transfer.pipeline_depth
            self.pool.ensure(layout, depth, staging_bound(layout, generation.plan.source_count))
        except SlotError as exc:
            raise RoundFailed(FailureReason.SLOTS_UNAVAILABLE, str(exc)) from exc
        if self.pool.epoch != self._attached_epoch or await self._engine_restarted():
            try:
                await asyncio.wait_for(
                    self.adapter.attach_buffers(self.pool.engine_slots(), self.pool.copy_count),
                    min(self.engine_timeout, runner.remaining()),
                )
                self._attached_epoch = self.pool.epoch
            except (EngineError, TimeoutError, ValueError) as exc:  # ValueError: slots refused
                # Still take part in the round (the collectives must stay in step); vote no.
                runner.error = RoundFailed(FailureReason.ENGINE_ATTACH_FAILED, f"attach: {exc!r}")
        return runner

    async def _engine_restarted(self) -> bool:
        """Whether another engine process than the one the slots went to answers now (a
        container restarted in place): it gets the slots again, then the whole version."""
        attached = self.adapter.attached_to
        try:
            health = await asyncio.wait_for(self.adapter.health(), _HEALTH_SECONDS)
        except (EngineError, TimeoutError):
            return False  # unreachable: the round's own calls will say so
        if health.incarnation is not None and health.incarnation != attached:
            log.warning(
                "engine incarnation %s is new: attaching the slots to it", health.incarnation[:8]
            )
            return True
        return False

    async def _round(self, generation: Generation, header: RoundHeader) -> None:
        started = time.monotonic()
        if self.before_round is not None:
            await self.before_round()
        self.book.started(generation)
        try:
            runner = await self._prepare(generation, header)
        except (RoundFailed, LayoutError, dist.DistError) as exc:
            reason = (
                exc.reason if isinstance(exc, RoundFailed) else FailureReason.LAYOUT_UNAVAILABLE
            )
            await self._refuse(generation, header, reason)
            self.book.finished(
                RoundOutcome.failed(
                    header.version,
                    generation.number,
                    started,
                    reason,
                    str(exc),
                    lineage=header.lineage,
                    stage=Stage.PREPARE,
                ),
            )
            return
        try:
            outcome = await runner.run(generation.plan.transfer.pipeline_depth)
        except Exception as exc:  # never a dead sink loop: fail the round, break the group
            log.exception("round %d failed unexpectedly", header.seq)
            await self._refuse(generation, header, FailureReason.INTERNAL_ERROR)
            outcome = RoundOutcome.failed(
                header.version,
                generation.number,
                started,
                FailureReason.INTERNAL_ERROR,
                repr(exc),
                lineage=header.lineage,
            )
        self.book.finished(outcome, runner.committed)

    async def _refuse(self, generation: Generation, header: RoundHeader, reason: str) -> None:
        """Fail a round this sink cannot take part in, so the others stop at once."""
        group = generation.group
        if group is None:
            return
        try:
            await group.run(lambda: group.ctl.set(failure_key(header.seq), f"refused: {reason}"))
        except (dist.DistError, RuntimeError) as exc:
            log.warning("could not refuse round %d: %s", header.seq, exc)
        generation.mark_broken(f"round {header.seq} refused: {reason}")
