"""The sink side: wait on the doorbell, receive buckets, hand them to the engine.

Bucket k+1 (and up to `depth - 1` more) is already being received into the other slot
while bucket k is copied to the engine's other devices (an engine of several GPUs reads
a copy on each, `agent.slot_pool`) and handed to the engine; a slot is reused only after
the engine's `load_bucket` for its previous bucket returned. The receives of the first `depth`
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
from functools import partial

import torch.distributed as dist

from weightsync.agent.doorbell import (
    RoundHeader,
    checksum_key,
)
from weightsync.agent.engine_lane import EngineLane
from weightsync.agent.failures import Stage
from weightsync.agent.generations import Generation
from weightsync.agent.holder import Holder
from weightsync.agent.rounds import RankRound, RoundFailed, RoundOutcome
from weightsync.agent.sharded import ShardPlans
from weightsync.agent.slot_pool import Replica, SlotPool
from weightsync.api.reasons import FailureReason
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.assembly import SlotRoutes
from weightsync.transfer.broadcast import TransferError, written_checksum
from weightsync.transfer.layout import Bucket, BucketLayout
from weightsync.transfer.shards import ShardPlan, single_source, staging_bound

log = logging.getLogger(__name__)


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
        shards: ShardPlan | None = None,
        plans: ShardPlans | None = None,
    ) -> None:
        super().__init__(generation, header.seq, pool.device)
        self.header = header
        self.layout = layout
        # How the buckets travel: one broadcast each from rank 0, or segments from
        # several source ranks (`agent.sharded`).
        self.shards = shards or single_source(layout)
        self.plans = plans or ShardPlans()  # where routes are kept between rounds
        self.staging = staging_bound(layout, generation.plan.source_count)
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

    async def _issue(self, routes: SlotRoutes, bucket: int, depth: int) -> list[dist.Work | None]:
        """Post the receives of every broadcast `bucket` travels in."""
        started = self.trace.now()
        sends = routes.sends(bucket, bucket % depth)
        works = await self.group.run(partial(self.group.transport.start_sends, sends))
        self.trace.add("issue", started)
        return works

    async def _stream(self, depth: int) -> list[int]:
        slots = self.pool.ensure(self.layout, depth, self.staging).slots
        routes = self.plans.routes(self.shards, slots)
        transport, buckets, trace = self.group.transport, self.layout.buckets, self.trace
        pending: deque[list[dist.Work | None]] = deque()
        checksums: list[int] = []
        trace.gpu_mark("first_issue")
        for issued in range(min(depth, len(buckets))):
            pending.append(await self._issue(routes, issued, depth))
        for bucket in buckets:
            started = trace.now()
            wait = partial(
                transport.wait_all,
                pending.popleft(),
                deadline=self._deadline(),
                failure_key=self.failure_key,
            )
            await self.group.run(wait)
            if routes.staged:
                await self.group.run(partial(routes.place, bucket.index, bucket.index % depth))
            trace.add("recv_wait", started)
            trace.gpu_mark("received")
            if self.holder is not None:  # copies the bucket out for P2P recovery
                slot = slots[bucket.index % depth]
                await self.holder.stage(self.header.version, self.layout, bucket, slot, depth)
            slot_index = bucket.index % depth
            if self.header.checksum:
                view = slots[slot_index][: bucket.nbytes]
                checksums.append(await self.group.run(partial(written_checksum, view, bucket)))
            # An engine on several devices reads a copy on each: copied beside the next
            # bucket's receive, complete before the engine is asked to load.
            replica = self.pool.replicate(slot_index, bucket.nbytes)
            load = self._engine(
                f"load bucket {bucket.index}",
                "engine_load",
                partial(self._load, replica, slot_index, bucket),
            )
            following = bucket.index + depth
            if following < len(buckets):  # it goes into this slot: the engine must be done
                if load is not None:
                    await self.lane.wait(load)
                await replica.wait()  # and the copies read from it
                pending.append(await self._issue(routes, following, depth))
        started = trace.now()
        await self.lane.drain()
        trace.add("engine_drain", started)
        trace.mark("streamed")
        return checksums

    async def _load(self, replica: Replica, slot: int, bucket: Bucket) -> None:
        if self.pool.copies:
            started = self.trace.now()
            await replica.wait()
            self.trace.add("replica_wait", started)
        await self.adapter.load_bucket(slot, bucket.tensors)

    async def _verify_checksums(self, mine: list[int]) -> None:
        ctl, deadline = self.group.ctl, self._deadline()

        def fetch() -> bytes:
            key = checksum_key(self.header.seq)
            while not ctl.check([key]):
                if ctl.check([self.failure_key]):
                    raise TransferError(FailureReason.PEER_FAILED, "a peer failed the round")
                if time.monotonic() > deadline:
                    raise TransferError(FailureReason.TIMEOUT, "the source's checksums never came")
                time.sleep(0.005)
            return ctl.get(key)

        expected = json.loads(await self.group.run(fetch))
        if expected != mine and self.error is None:
            bad = [i for i, (a, b) in enumerate(zip(expected, mine, strict=False)) if a != b]
            self.error = RoundFailed(
                FailureReason.CHECKSUM_MISMATCH, f"buckets {bad[:8]} differ", Stage.TRANSFER
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
                    FailureReason.PEER_ERROR, "another rank failed the round", Stage.TRANSFER
                )
            finish = self._engine(
                "finish", "engine_finish", lambda: self.adapter.finish_update(version)
            )
            if finish is not None:
                await finish
            self.committed = self._round_error() is None
            if await self._vote(int(self._round_error() is not None), "vote_commit"):
                raise self._round_error() or RoundFailed(
                    FailureReason.COMMIT_FAILED, "another engine did not commit", Stage.COMMIT
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
            stage=failure.stage,
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
                min(self.engine_timeout, self.grace()),
            )
        except (EngineError, TimeoutError) as exc:
            # Not waited for longer: the next round's begin drops what this one staged.
            log.warning("engine abort failed: %s", exc)

    async def _fail_hard(self, failure: RoundFailed) -> None:
        await self._flag_failure(self.header.version, f"rank {self.generation.plan.rank}", failure)
        await self._abort_engine(failure.reason)
