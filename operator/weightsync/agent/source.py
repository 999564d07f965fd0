"""The source side of a round: Publisher fills a slot, the agent broadcasts it.

Bucket k is filled by the Publisher (a D2D copy into the agent's slot k % depth) while
bucket k-1 is still on the wire; a slot is handed back to the Publisher only after
its broadcast completed. In Colocated mode the source also drives a local engine,
which reads the same slots: that is the whole transport (no peers, no broadcast).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

import torch.distributed as dist

from weightsync.agent.generations import Generation
from weightsync.agent.rounds import (
    RoundFailed,
    RoundHeader,
    RoundOutcome,
    checksum_key,
    doorbell_key,
    failure_key,
    layout_key,
)
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.broadcast import TransferError, bucket_checksum
from weightsync.transfer.buffers import BucketSlots
from weightsync.transfer.layout import BucketLayout

log = logging.getLogger(__name__)


class FillChannel(Protocol):
    async def fill(self, bucket: int, slot: int) -> None:
        """Have the Publisher copy bucket `bucket` into slot `slot`; raise `RoundFailed`."""


class SourceRound:
    def __init__(
        self,
        generation: Generation,
        layout: BucketLayout,
        slots: BucketSlots,
        version: int,
        channel: FillChannel,
        *,
        local_engine: EngineAdapter | None,
        engine_timeout_seconds: float,
    ) -> None:
        if generation.group is None:
            raise RoundFailed("no_group", f"generation {generation.number} is not formed")
        self.generation = generation
        self.group = generation.group
        self.layout = layout
        self.slots = slots
        self.version = version
        self.channel = channel
        self.local_engine = local_engine
        self.engine_timeout = engine_timeout_seconds
        self.timeout = generation.plan.transfer.timeout_seconds
        self.checksum = generation.plan.transfer.checksum
        self.seq = generation.next_seq
        generation.next_seq += 1
        self.failure_key = failure_key(self.seq)
        self.error: RoundFailed | None = None  # a soft failure: the round runs on, then fails

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    async def _local(self, what: str, call: Callable[[], Awaitable[None]]) -> None:
        """Drive the local (Colocated) engine; its failure fails the round softly."""
        if self.error is not None:
            return
        try:
            await asyncio.wait_for(call(), self.engine_timeout)
        except EngineError as exc:
            self.error = RoundFailed(f"engine_{exc.reason}", f"{what}: {exc}")
        except TimeoutError:
            self.error = RoundFailed("engine_timeout", f"{what} timed out")

    async def _announce(self) -> None:
        ctl = self.group.ctl
        header = RoundHeader(
            seq=self.seq,
            version=self.version,
            layout_hash=self.layout.layout_hash,
            bucket_count=len(self.layout.buckets),
            checksum=self.checksum,
        )
        layout_hash = self.layout.layout_hash

        def announce() -> None:
            if layout_hash not in self.generation.layouts_sent:
                ctl.set(layout_key(layout_hash), self.layout.to_json())
            ctl.set(doorbell_key(self.seq), header.model_dump_json())

        await self.group.run(announce)
        self.generation.layouts_sent.add(layout_hash)

    async def _stream(self) -> list[int]:
        transport, depth = self.group.transport, len(self.slots.slots)
        in_flight: deque[dist.Work | None] = deque()
        checksums: list[int] = []
        for bucket in self.layout.buckets:
            slot_index = bucket.index % depth
            if len(in_flight) == depth:  # the slot's previous bucket must be off the wire
                await self._wait(in_flight.popleft())
            if self.error is None:
                try:
                    await self.channel.fill(bucket.index, slot_index)
                except RoundFailed as exc:
                    self.error = exc
            view = self.slots.slots[slot_index][: bucket.nbytes]
            if self.local_engine is not None:
                load = partial(self.local_engine.load_bucket, slot_index, bucket.tensors)
                await self._local(f"load bucket {bucket.index}", load)
            if self.checksum:
                checksums.append(await self.group.run(partial(bucket_checksum, view)))
            in_flight.append(await self.group.run(partial(transport.start_bucket, view)))
        while in_flight:
            await self._wait(in_flight.popleft())
        return checksums

    async def _wait(self, work: dist.Work | None) -> None:
        wait = partial(
            self.group.transport.wait,
            work,
            deadline=self._deadline(),
            failure_key=self.failure_key,
        )
        await self.group.run(wait)

    async def _vote(self, flag: int) -> int:
        transport, deadline = self.group.transport, self._deadline()
        return await self.group.run(
            lambda: transport.agree_max(flag, deadline=deadline, failure_key=self.failure_key)
        )

    async def run(self) -> RoundOutcome:
        started = time.monotonic()
        number = self.generation.number
        try:
            await self._announce()
            engine = self.local_engine
            if engine is not None:
                await self._local("begin", lambda: engine.begin_update(self.version))
            checksums = await self._stream()
            if self.checksum:
                payload = json.dumps(checksums)
                await self.group.run(lambda: self.group.ctl.set(checksum_key(self.seq), payload))
            if await self._vote(int(self.error is not None)):
                raise self.error or RoundFailed("peer_error", "a sink failed the round")
            if engine is not None:
                await self._local("finish", lambda: engine.finish_update(self.version))
            if await self._vote(int(self.error is not None)):
                raise self.error or RoundFailed("commit_failed", "a sink's engine did not commit")
        except (TransferError, dist.DistError) as exc:
            reason = exc.reason if isinstance(exc, TransferError) else "store_error"
            await self._fail_hard(reason, str(exc))
            return RoundOutcome.failed(self.version, number, started, reason, str(exc))
        except RoundFailed as exc:
            await self._abort_local(exc.reason)
            return RoundOutcome.failed(self.version, number, started, exc.reason, str(exc))
        return RoundOutcome(
            version=self.version,
            generation=number,
            ok=True,
            duration_seconds=time.monotonic() - started,
            nbytes=self.layout.total_bytes,
            finished_at=time.time(),
        )

    async def _abort_local(self, reason: str) -> None:
        if self.local_engine is None:
            return
        try:
            await asyncio.wait_for(
                self.local_engine.abort_update(self.version, reason), self.engine_timeout
            )
        except (EngineError, TimeoutError) as exc:
            log.warning("local engine abort failed: %s", exc)

    async def _fail_hard(self, reason: str, message: str) -> None:
        """Tell the peers (failure key), abort the communicator, drop the local update."""
        log.warning("round %d (version %d) failed: %s", self.seq, self.version, message)

        def flag() -> None:
            try:
                self.group.ctl.set(self.failure_key, f"source: {reason}")
            except dist.DistError as exc:
                log.warning("could not set the failure key: %s", exc)

        try:
            await asyncio.wait_for(self.group.run(flag), 5.0)
        except TimeoutError:
            log.warning("setting the failure key timed out")
        self.generation.mark_broken(f"round {self.seq} failed: {reason}")
        await self._abort_local(reason)
