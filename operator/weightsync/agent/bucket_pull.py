"""Bucket-by-bucket pulls of a held version into an agent's slots (the recovery data path).

Bucket k is read from the holders with `p2p.pull` into slot k % depth, up to `depth`
buckets ahead of the consumer (the engine's `load_bucket`), each from every live holder
with the bucket's preferred holder rotating, so holders take turns; the bucket's
checksum is verified as it lands. A holder whose read or checksum fails is dropped for
the rest of the pull.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from weightsync.api.reasons import RecoveryFailureReason
from weightsync.transfer.held import held_checksum, held_offsets
from weightsync.transfer.layout import Bucket, BucketLayout
from weightsync.transfer.p2p import (
    Chunk,
    HeldRegion,
    P2PError,
    PullReport,
    TransferEngineEndpoint,
    pull,
)


@dataclass
class PullSummary:
    bytes: int = 0  # bytes of the buckets pulled so far
    bytes_by_holder: dict[str, int] = field(default_factory=dict)
    failed_holders: dict[str, str] = field(default_factory=dict)  # name -> why dropped


LoadBucket = Callable[[Bucket, int], Awaitable[None]]  # (bucket, slot index)


class _BucketPuller:
    """Pulls one bucket at a time into its slot; shared by the reader threads in flight."""

    def __init__(
        self,
        endpoint: TransferEngineEndpoint,
        holders: Sequence[HeldRegion],
        layout: BucketLayout,
        checksums: Sequence[int],
        slots: Sequence[torch.Tensor],
        *,
        deadline: float,
        summary: PullSummary,
    ) -> None:
        self.endpoint = endpoint
        self.checksums = checksums
        self.slots = slots
        self.deadline = deadline
        self.offsets = held_offsets(layout)
        self.landing = _landing_buffers(slots, layout.capacity_bytes)
        self.summary = summary
        self._live = list(holders)
        self._lock = threading.Lock()

    def pull(self, bucket: Bucket) -> None:
        index, depth = bucket.index, len(self.slots)
        with self._lock:
            live = list(self._live)
        if not live:
            raise P2PError(
                RecoveryFailureReason.NO_LIVE_HOLDER, f"no holder left for bucket {index}"
            )
        turn = index % len(live)
        regions = [  # the bucket's preferred holder first, so holders take turns
            replace(h, address=h.address + self.offsets[index], nbytes=bucket.nbytes)
            for h in live[turn:] + live[:turn]
        ]
        target = self.landing[index % depth][: bucket.nbytes]
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise P2PError(
                RecoveryFailureReason.TIMEOUT, f"the recovery timed out before bucket {index}"
            )
        try:
            report = pull(
                self.endpoint,
                regions,
                [Chunk(0, bucket.nbytes, self.checksums[index])],
                target,
                checksum=partial(held_checksum, bucket=bucket),
                timeout_seconds=remaining,
            )
        except P2PError as exc:
            if exc.report is not None:
                self._account(exc.report)
            raise
        self._account(report)
        slot = self.slots[index % depth]
        if target.data_ptr() != slot.data_ptr():
            slot[: bucket.nbytes].copy_(target)

    def _account(self, report: PullReport) -> None:
        with self._lock:
            summary = self.summary
            for name, moved in report.bytes_by_holder.items():
                summary.bytes_by_holder[name] = summary.bytes_by_holder.get(name, 0) + moved
            for name, why in report.failed_holders.items():
                summary.failed_holders.setdefault(name, why)
            self._live = [h for h in self._live if h.name not in summary.failed_holders]


async def pull_buckets(
    endpoint: TransferEngineEndpoint,
    holders: Sequence[HeldRegion],
    layout: BucketLayout,
    checksums: Sequence[int],
    slots: Sequence[torch.Tensor],
    *,
    deadline: float,
    load: LoadBucket | None = None,
    summary: PullSummary | None = None,
) -> PullSummary:
    """Pull every bucket of `layout` from `holders` into `slots`; `load` each in order.

    Bucket k lands in slot k % len(slots); up to len(slots) buckets are in flight ahead
    of `load`, and a slot is reused only after `load` of its previous bucket returned.
    `holders` address bucket 0 of their held copy. Progress and dropped holders go to
    `summary` as they happen. Raises `P2PError` when a bucket cannot be had.
    """
    summary = PullSummary() if summary is None else summary
    puller = _BucketPuller(
        endpoint, holders, layout, checksums, slots, deadline=deadline, summary=summary
    )
    for buffer in puller.landing:
        endpoint.register(buffer)
    buckets, depth = layout.buckets, len(slots)
    in_flight: deque[asyncio.Task[None]] = deque()
    issued = 0
    try:
        for bucket in buckets:
            while issued < len(buckets) and issued < bucket.index + depth:
                task = asyncio.to_thread(puller.pull, buckets[issued])
                in_flight.append(asyncio.ensure_future(task))
                issued += 1
            await in_flight.popleft()
            summary.bytes += bucket.nbytes
            if load is not None:
                await load(bucket, bucket.index % depth)
    finally:
        # Reads still in flight write into our slots: let them end before anyone reuses them.
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
        for buffer in puller.landing:
            endpoint.unregister(buffer)
    return summary


def _landing_buffers(slots: Sequence[torch.Tensor], capacity: int) -> list[torch.Tensor]:
    """Where pulled bytes land: the slots themselves on CPU, pinned host buffers on GPU."""
    if all(slot.device.type == "cpu" for slot in slots):
        return list(slots)
    return [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in slots]
