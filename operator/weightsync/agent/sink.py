"""The sink side: wait on the doorbell, receive buckets, hand them to the engine.

Bucket k+1 (and up to `depth - 1` more) is already being received into the other slot
while bucket k is handed to the engine; a slot is reused only after the engine's
`load_bucket` for its previous bucket returned. The receives of the first `depth`
buckets are posted before the engine's `begin_update` returns (they only need slots),
so the source's first broadcast does not wait on the engine. An engine failure does not break the
pipeline: the sink keeps receiving (so the collectives stay in step) and votes to fail
the round at the end. A transport failure breaks the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from weightsync.agent.doorbell import (
    DOORBELL,
    Doorbell,
    RoundHeader,
    SwitchNotice,
    checksum_key,
    doorbell_key,
    failure_key,
    layout_key,
)
from weightsync.agent.engine_lane import EngineLane
from weightsync.agent.failures import Stage
from weightsync.agent.generations import Generation, Generations
from weightsync.agent.holder import Holder
from weightsync.agent.rounds import FAILURE_GRACE_SECONDS, RankRound, RoundFailed, RoundOutcome
from weightsync.agent.slot_pool import SlotPool
from weightsync.api.control import GenerationState
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.broadcast import TransferError, bucket_checksum
from weightsync.transfer.buffers import SlotError
from weightsync.transfer.layout import BucketLayout, LayoutError

log = logging.getLogger(__name__)

_DOORBELL_SLICE = timedelta(seconds=10)
_HEALTH_SECONDS = 1.0  # the pre-round check of which engine process answers


class SinkRound(RankRound):
    def __init__(
        self,
        generation: Generation,
        header: RoundHeader,
        layout: BucketLayout,
        pool: SlotPool,
        adapter: EngineAdapter,
        *,
        engine_timeout_seconds: float,
        holder: Holder | None = None,
    ) -> None:
        super().__init__(generation, header.seq, pool.device)
        self.header = header
        self.layout = layout
        self.pool = pool
        self.adapter = adapter
        self.engine_timeout = engine_timeout_seconds
        self.holder = holder
        self.committed = False
        self.lane = EngineLane(engine_timeout_seconds, self.trace, self.deadline)

    def _round_error(self) -> RoundFailed | None:
        return self.error or self.lane.error

    def _engine(
        self, what: str, phase: str, call: Callable[[], Awaitable[None]]
    ) -> asyncio.Task[None] | None:
        """Queue an engine call on the lane, unless this rank already failed the round."""
        if self.error is not None:
            return None
        return self.lane.submit(what, phase, call)

    async def _issue(self, view: torch.Tensor) -> dist.Work | None:
        started = self.trace.now()
        work = await self.group.run(partial(self.group.transport.start_bucket, view))
        self.trace.add("issue", started)
        return work

    async def _stream(self, depth: int) -> list[int]:
        slots = self.pool.ensure(self.layout, depth).slots
        transport, buckets, trace = self.group.transport, self.layout.buckets, self.trace
        pending: deque[dist.Work | None] = deque()
        checksums: list[int] = []
        trace.gpu_mark("first_issue")
        for issued in range(min(depth, len(buckets))):
            pending.append(await self._issue(slots[issued % depth][: buckets[issued].nbytes]))
        for bucket in buckets:
            started = trace.now()
            wait = partial(
                transport.wait,
                pending.popleft(),
                deadline=self._deadline(),
                failure_key=self.failure_key,
            )
            await self.group.run(wait)
            trace.add("recv_wait", started)
            trace.gpu_mark("received")
            if self.holder is not None:  # copies the bucket out for P2P recovery
                slot = slots[bucket.index % depth]
                await self.holder.stage(self.header.version, self.layout, bucket, slot, depth)
            slot_index = bucket.index % depth
            if self.header.checksum:
                view = slots[slot_index][: bucket.nbytes]
                checksums.append(await self.group.run(partial(bucket_checksum, view)))
            load = self._engine(
                f"load bucket {bucket.index}",
                "engine_load",
                partial(self.adapter.load_bucket, slot_index, bucket.tensors),
            )
            following = bucket.index + depth
            if following < len(buckets):  # it goes into this slot: the engine must be done
                if load is not None:
                    await self.lane.wait(load)
                pending.append(await self._issue(slots[slot_index][: buckets[following].nbytes]))
        started = trace.now()
        await self.lane.drain()
        trace.add("engine_drain", started)
        trace.mark("streamed")
        return checksums

    async def _verify_checksums(self, mine: list[int]) -> None:
        ctl, deadline = self.group.ctl, self._deadline()

        def fetch() -> bytes:
            key = checksum_key(self.header.seq)
            while not ctl.check([key]):
                if ctl.check([self.failure_key]):
                    raise TransferError("peer_failed", "a peer failed the round")
                if time.monotonic() > deadline:
                    raise TransferError("timeout", "the source's checksums never came")
                time.sleep(0.005)
            return ctl.get(key)

        expected = json.loads(await self.group.run(fetch))
        if expected != mine and self.error is None:
            bad = [i for i, (a, b) in enumerate(zip(expected, mine, strict=False)) if a != b]
            self.error = RoundFailed(
                "checksum_mismatch", f"buckets {bad[:8]} differ", Stage.TRANSFER
            )

    async def run(self, depth: int) -> RoundOutcome:
        started, version = time.monotonic(), self.header.version
        number = self.generation.number
        try:
            self._engine("begin", "engine_begin", lambda: self.adapter.begin_update(version))
            checksums = await self._stream(depth)
            if self.header.checksum:
                await self._verify_checksums(checksums)
            if await self._vote(int(self._round_error() is not None), "vote_transfer"):
                raise self._round_error() or RoundFailed(
                    "peer_error", "another rank failed the round", Stage.TRANSFER
                )
            finish = self._engine(
                "finish", "engine_finish", lambda: self.adapter.finish_update(version)
            )
            if finish is not None:
                await finish
            self.committed = self._round_error() is None
            if await self._vote(int(self._round_error() is not None), "vote_commit"):
                raise self._round_error() or RoundFailed(
                    "commit_failed", "another engine did not commit", Stage.COMMIT
                )
        except (TransferError, dist.DistError) as exc:
            # This rank's own failure (its engine's), if it had one, is what it reports.
            failure = self._round_error() or self._transfer_failure(exc)
            await self._fail_hard(failure)
            return self._failed(started, failure)
        except RoundFailed as exc:
            await self._abort_engine(exc.reason)
            return self._failed(started, exc)
        self._log_trace(ok=True)
        return RoundOutcome(
            version=version,
            generation=number,
            ok=True,
            duration_seconds=time.monotonic() - started,
            nbytes=self.layout.total_bytes,
            finished_at=time.time(),
            lineage=self.header.lineage,
        )

    def _failed(self, started: float, failure: RoundFailed) -> RoundOutcome:
        self._log_trace(ok=False)
        header = self.header
        return RoundOutcome.failed(
            header.version,
            self.generation.number,
            started,
            failure.reason,
            str(failure),
            lineage=header.lineage,
            stage=failure.stage.value,
        )

    def _log_trace(self, *, ok: bool) -> None:
        self.trace.log(
            seq=self.header.seq,
            version=self.header.version,
            role="sink",
            rank=self.generation.plan.rank,
            ok=ok,
            buckets=len(self.layout.buckets),
            bytes=self.layout.total_bytes,
        )

    async def _abort_engine(self, reason: str) -> None:
        await self.lane.cancel()  # the engine takes one call at a time
        if self.committed:  # this engine serves the version; the others did not
            return
        try:
            await asyncio.wait_for(
                self.adapter.abort_update(self.header.version, reason),
                min(self.engine_timeout, FAILURE_GRACE_SECONDS),
            )
        except (EngineError, TimeoutError) as exc:
            # Not waited for longer: the next round's begin drops what this one staged.
            log.warning("engine abort failed: %s", exc)

    async def _fail_hard(self, failure: RoundFailed) -> None:
        await self._flag_failure(self.header.version, f"rank {self.generation.plan.rank}", failure)
        await self._abort_engine(failure.reason)


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
        before_round: Callable[[], Awaitable[None]] | None = None,
        on_round_start: Callable[[Generation], None],
        on_round_end: Callable[[RoundOutcome, bool], None],
    ) -> None:
        self.generations = generations
        self.pool = pool
        self.adapter = adapter
        self.engine_timeout = engine_timeout_seconds
        self.holder = holder
        self.before_round = before_round
        self.on_round_start = on_round_start
        self.on_round_end = on_round_end
        self._layouts: dict[str, BucketLayout] = {}
        self._attached_epoch = -1

    async def run_forever(self) -> None:
        while True:
            generation = self.generations.oldest_listenable()
            if generation is None:
                async with self.generations.changed:
                    await self.generations.changed.wait()
                continue
            bell = await self._wait_doorbell(generation)
            if bell is None:
                continue
            generation.take_seq()
            if isinstance(bell, SwitchNotice):
                log.info("switching from generation %d to %d", generation.number, bell.generation)
                generation.retire()
                continue
            await self._round(generation, bell)

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
                raise RoundFailed("no_group", "generation not formed")
            raw = await group.run(lambda: group.ctl.get(layout_key(layout_hash)))
            layout = BucketLayout.from_json(raw)
            self._layouts[layout_hash] = layout
        return layout

    async def _prepare(self, generation: Generation, header: RoundHeader) -> SinkRound:
        """The layout (fetched once per hash), slots and engine attachment for a round."""
        if not generation.usable:
            raise RoundFailed("group_broken", f"generation {generation.number} is broken")
        layout = await self._layout(generation, header.layout_hash)
        if len(layout.buckets) != header.bucket_count:
            raise LayoutError("bucket count disagrees with the layout")
        runner = SinkRound(
            generation,
            header,
            layout,
            self.pool,
            self.adapter,
            engine_timeout_seconds=self.engine_timeout,
            holder=self.holder,
        )
        try:
            slots = self.pool.ensure(layout, generation.plan.transfer.pipeline_depth)
        except SlotError as exc:
            raise RoundFailed("slots_unavailable", str(exc)) from exc
        if self.pool.epoch != self._attached_epoch or await self._engine_restarted():
            try:
                await asyncio.wait_for(
                    self.adapter.attach_buffers(slots.slots),
                    min(self.engine_timeout, runner.remaining()),
                )
                self._attached_epoch = self.pool.epoch
            except (EngineError, TimeoutError) as exc:
                # Still take part in the round (the collectives must stay in step); vote no.
                runner.error = RoundFailed("engine_attach_failed", f"attach: {exc!r}")
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
        self.on_round_start(generation)
        try:
            runner = await self._prepare(generation, header)
        except (RoundFailed, LayoutError, dist.DistError) as exc:
            reason = exc.reason if isinstance(exc, RoundFailed) else "layout_unavailable"
            await self._refuse(generation, header, reason)
            self.on_round_end(
                RoundOutcome.failed(
                    header.version,
                    generation.number,
                    started,
                    reason,
                    str(exc),
                    lineage=header.lineage,
                    stage=Stage.PREPARE.value,
                ),
                False,
            )
            return
        try:
            outcome = await runner.run(generation.plan.transfer.pipeline_depth)
        except Exception as exc:  # never a dead sink loop: fail the round, break the group
            log.exception("round %d failed unexpectedly", header.seq)
            await self._refuse(generation, header, "internal_error")
            outcome = RoundOutcome.failed(
                header.version,
                generation.number,
                started,
                "internal_error",
                repr(exc),
                lineage=header.lineage,
            )
        self.on_round_end(outcome, runner.committed)

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
