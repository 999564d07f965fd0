"""The holder: the latest committed version in host memory, for P2P recovery pulls.

A holder keeps one contiguous host buffer per version, laid out like the rounds'
buckets (bucket b at `held_offsets(layout)[b]`), registered once with its Mooncake
endpoint. Peers read it passively through the transfer engine; nothing here runs for
a pull.

It is filled *while the round runs*. A source agent that maps the Publisher's tensors
(GPU) calls `stage_tensors` once per round: every tensor is copied device-to-host on a
side stream beside the broadcast; the round's result does not wait for it, and the copy
is committed only once the Publisher fences (`SourceLoop.fence`: it has not written its
tensors meanwhile). Otherwise the round calls `stage` once per bucket, right after the
bucket was broadcast (source) or received (sink), copied out before the slot's reuse:
* on GPU, a non-blocking D2H copy into pinned memory on a side stream; the device's
  current stream then waits for it (so the next receive into that slot is ordered after
  it), and `stage` keeps at most `depth - 1` copies in flight on the host side (the
  source's Publisher refills a slot from another process, which no stream orders);
* on CPU, a plain copy (in a worker thread, off the event loop).
Each bucket's checksum (`held_checksum`, CRC-32 over the held host bytes of its tensors,
so it is what a puller reads; the alignment padding between tensors is left out, since
holders fill it differently) is computed by a background thread, off the round's path.

Host buffers are allocated (page-locked a slice at a time, pausing while rounds run:
`agent.host_memory`) and registered off the round's path: `prepare`, called once the
layout is known (the source's attach), asks for two; a round that finds none ready is
not held, instead of waiting for a model-sized pinned allocation (14-20 s for 8B bf16).
Buffers of at most `_INLINE_ALLOCATION_BYTES` are allocated in the round (milliseconds).

Two buffers, flipped on commit: the round stages into the spare buffer and `commit`
makes it the held one, the old held buffer becoming the next round's spare. So a failed
round (`abandon`) never touches the held copy, and a commit costs no copy. The price is
two model-sized host buffers per holder, against one for copy-on-commit, which would
need a full host-to-host copy (seconds for a large model) after every round, during
which the held version would be unreadable. A pull that outlives two rounds reads a
buffer that is being restaged; pulls verify every bucket's checksum, so it fails over
or fails instead of loading mixed bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from weightsync.agent.host_copies import (
    CopyQueue,
    SideStream,
    VoteGate,
    checksum_after,
    copy_groups,
    within_slices,
)
from weightsync.agent.host_memory import PinGate, PinnedBuffer, PinningError
from weightsync.agent.metrics import AgentMetrics
from weightsync.api.control import Holding
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.transfer.buffers import copy_tensors, slot_views
from weightsync.transfer.held import held_checksum, held_offsets
from weightsync.transfer.layout import Bucket, BucketLayout
from weightsync.transfer.p2p import Endpoints, P2PError, TransferEngineEndpoint

log = logging.getLogger(__name__)

_HOLDING_WAIT_SECONDS = 60.0  # how long GET /v1/holding waits for a fresh commit's checksums
_HOLD_QUEUE_BYTES = 64 << 20  # device-to-host bytes `stage_tensors` keeps queued at most
_INLINE_ALLOCATION_BYTES = 64 << 20  # larger host buffers are allocated in the background
_BUFFERS = 2  # the held copy and the next round's staging copy


@dataclass(eq=False)
class HostCopy:
    """One version in one host buffer: the staging copy of a round, or the held one."""

    buffer: torch.Tensor  # 1-D uint8, registered with the endpoint
    version: int
    layout: BucketLayout
    offsets: list[int]
    checksums: dict[int, Future[int]] = field(default_factory=dict)  # by bucket index
    lineage: str = ""  # set when the round commits

    @property
    def complete(self) -> bool:
        return len(self.checksums) == len(self.layout.buckets)


class Holder:
    """Stages rounds into host memory and serves the last committed one (see module doc)."""

    def __init__(
        self,
        device: torch.device,
        endpoints: Endpoints,
        protocol: RecoveryProtocol,
        metrics: AgentMetrics,
        *,
        enabled: bool,
        yield_to_votes: bool = True,
    ) -> None:
        self.device = device
        self.protocol = protocol
        self._endpoints = endpoints
        self._metrics = metrics
        self._enabled = enabled
        self._endpoint: TransferEngineEndpoint | None = None
        self._held: HostCopy | None = None
        self._staging: HostCopy | None = None
        self._staging_failed = False  # a copy of this round failed: never commit it
        self._round: tuple[int, str] | None = None  # (version, layout hash) being staged
        self._free: list[torch.Tensor] = []  # registered buffers neither held nor staging
        self._allocating: asyncio.Task[None] | None = None  # `prepare`'s background work
        self._epoch = 0  # bumped by `release`: an allocation finishing later is dropped
        self._pinned: dict[int, PinnedBuffer] = {}  # GPU agents' buffers, by address
        self._in_flight: deque[torch.cuda.Event] = deque()
        self._copies = SideStream()
        self.votes = VoteGate(enabled=yield_to_votes)  # closed by a round while it votes
        self.pinning = PinGate()  # closed by the rounds (`RoundBook`): pinning waits for them
        self._checksummer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="holder-crc")

    @property
    def enabled(self) -> bool:
        return self._enabled

    def set_enabled(self, enabled: bool) -> None:
        """Start or stop holding; stopping frees both host buffers at once."""
        if self._enabled and not enabled:
            log.info("no longer a holder: releasing the held version")
            self.release()
        self._enabled = enabled

    @property
    def held_version(self) -> int | None:
        return self._held.version if self._held is not None else None

    @property
    def held_lineage(self) -> str | None:
        return self._held.lineage if self._held is not None else None

    async def stage(
        self, version: int, layout: BucketLayout, bucket: Bucket, slot: torch.Tensor, depth: int
    ) -> None:
        """Copy `bucket` (its bytes are `slot`) of round `version` into the staging copy.

        Returns once at most `depth - 1` of this holder's copies still read a slot. Never
        raises: a holder's trouble must not fail the round; the staging copy is dropped.
        """
        if not self._enabled:
            return
        try:
            await self._stage(version, layout, bucket, slot, depth)
        except (P2PError, RuntimeError, MemoryError, OSError) as exc:
            log.warning(
                "holder: staging bucket %d of version %d failed: %s", bucket.index, version, exc
            )
            self._staging_failed = True

    async def _stage(
        self, version: int, layout: BucketLayout, bucket: Bucket, slot: torch.Tensor, depth: int
    ) -> None:
        if bucket.index == 0 or self._round != (version, layout.layout_hash):
            await self._begin(version, layout)
        staging = self._staging
        if staging is None or self._staging_failed:
            return
        offset = staging.offsets[bucket.index]
        target = staging.buffer[offset : offset + bucket.nbytes]
        source = slot[: bucket.nbytes]
        pieces = self._within_slices(staging, [(target, source)])
        if source.is_cuda and pieces:
            done = self._copies.after_current(pieces)
            self._in_flight.append(done)
            staging.checksums[bucket.index] = self._checksummer.submit(
                checksum_after, done, target, bucket
            )
            while len(self._in_flight) > depth - 1:
                await asyncio.to_thread(self._in_flight.popleft().synchronize)
        else:
            await asyncio.to_thread(target.copy_, source)
            staging.checksums[bucket.index] = self._checksummer.submit(
                held_checksum, target, bucket
            )

    async def stage_tensors(
        self, version: int, layout: BucketLayout, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Copy round `version` into a staging copy straight from the published tensors.

        For a source agent that maps the Publisher's tensors: the device-to-host copies
        (PCIe-bound, about 6x the NVLink broadcast of the same bytes) then run on a side
        stream beside the broadcast instead of holding each slot until its bucket is out,
        so the engines get the version at the broadcast's pace. At most
        `_HOLD_QUEUE_BYTES` are queued at a time, and none while the round votes
        (`VoteGate`): the votes' flags are read device-to-host too. The caller keeps the
        tensors unwritten until this returns. Never raises, as `stage`.
        """
        if not self._enabled:
            return
        try:
            staging = await self._begin(version, layout)
            if staging is None:
                return
            queue = CopyQueue(self._copies, self.votes, _HOLD_QUEUE_BYTES)
            for bucket in layout.buckets:
                at = staging.offsets[bucket.index]
                region = staging.buffer[at : at + bucket.nbytes]
                targets = slot_views(region, bucket.tensors)
                sources = [tensors[t.name] for t in bucket.tensors]
                if not (sources and sources[0].is_cuda):
                    await self.votes.passed()
                    await asyncio.to_thread(copy_tensors, targets, sources)
                    staging.checksums[bucket.index] = self._checksummer.submit(
                        held_checksum, region, bucket
                    )
                    continue
                done = None
                pieces = self._within_slices(staging, zip(targets, sources, strict=True))
                pairs = list(zip(*pieces, strict=True)) if pieces else [(), ()]
                for group in copy_groups(pairs[0], pairs[1], _HOLD_QUEUE_BYTES // 2):
                    done = await queue.put(group)
                staging.checksums[bucket.index] = (
                    self._checksummer.submit(checksum_after, done, region, bucket)
                    if done is not None
                    else self._checksummer.submit(held_checksum, region, bucket)  # no bytes
                )
            await queue.drain()
        except (P2PError, RuntimeError, MemoryError, OSError, KeyError) as exc:
            log.warning("holder: staging version %d from its tensors failed: %s", version, exc)
            self._staging_failed = True

    async def _begin(self, version: int, layout: BucketLayout) -> HostCopy | None:
        """A fresh staging copy for `version` in a free buffer; None (the round is not
        held) while a large enough buffer is still being allocated."""
        if self._staging is not None:
            self._free.append(self._staging.buffer)
            self._staging = None
        self._staging_failed = False
        self._round = (version, layout.layout_hash)
        self._in_flight.clear()
        need = max(layout.total_bytes, 1)
        buffer = self._take(need)
        if buffer is None and need <= _INLINE_ALLOCATION_BYTES:
            buffer = await asyncio.to_thread(self._allocate, need)
        if buffer is None:
            self.prepare(need)
            log.info(
                "holder: version %d is not held: its host buffers are being allocated", version
            )
            return None
        self._staging = HostCopy(buffer, version, layout, held_offsets(layout))
        return self._staging

    def _within_slices(
        self, staging: HostCopy, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`pairs` cut where the staging buffer's page-locked slices meet (GPU agents)."""
        pinned = self._pinned.get(staging.buffer.data_ptr())
        if pinned is None:
            return list(pairs)
        return within_slices(pairs, pinned.tensor.data_ptr(), pinned.slice_bytes)

    def prepare(self, nbytes: int) -> None:
        """Have `_BUFFERS` registered buffers of at least `nbytes` (the held one counts),
        allocating the missing ones in the background; smaller free ones are dropped."""
        if not self._enabled or (self._allocating is not None and not self._allocating.done()):
            return
        need = max(nbytes, 1)
        small = [b for b in self._free if b.numel() < need]
        self._free = [b for b in self._free if b.numel() >= need]  # not list.remove: `_take`
        for buffer in small:
            self._unregister(buffer)
        in_use = [c.buffer for c in (self._held, self._staging) if c is not None]
        missing = _BUFFERS - sum(1 for b in [*self._free, *in_use] if b.numel() >= need)
        if missing > 0:
            self._allocating = asyncio.create_task(
                self._allocate_free(need, missing, self._epoch), name="holder-allocate"
            )

    async def _allocate_free(self, nbytes: int, count: int, epoch: int) -> None:
        for _ in range(count):
            try:
                buffer = await asyncio.to_thread(self._allocate, nbytes)
            except (P2PError, PinningError, RuntimeError, MemoryError, OSError) as exc:
                log.warning("holder: allocating %d B of host memory failed: %s", nbytes, exc)
                return
            if epoch != self._epoch or not self._enabled:  # released meanwhile
                self._unregister(buffer)
                return
            self._free.append(buffer)

    def _take(self, nbytes: int) -> torch.Tensor | None:
        """A free buffer of at least `nbytes` (the smallest such), or None."""
        fits = [b for b in self._free if b.numel() >= nbytes]
        if not fits:
            return None
        buffer = min(fits, key=torch.Tensor.numel)
        # By identity: list.remove's == is elementwise on tensors (raises across sizes).
        self._free = [b for b in self._free if b is not buffer]
        return buffer

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A registered host buffer (page-locked for a GPU agent: `host_memory`); runs
        off the event loop."""
        started = time.monotonic()
        if self._endpoint is None:
            self._endpoint = self._endpoints.get(self.protocol)
        if self.device.type == "cuda":
            pinned = PinnedBuffer(nbytes, self.device, self.pinning)
            buffer = pinned.tensor
            self._pinned[buffer.data_ptr()] = pinned
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        self._endpoint.register(buffer)
        self._metrics.holder_host_bytes.inc(buffer.numel())
        log.info(
            "holder: registered %d B of host memory in %.2f s", nbytes, time.monotonic() - started
        )
        return buffer

    def _unregister(self, buffer: torch.Tensor) -> None:
        if self._endpoint is not None:
            self._endpoint.unregister(buffer)
            self._metrics.holder_host_bytes.dec(buffer.numel())
        pinned = self._pinned.pop(buffer.data_ptr(), None)
        if pinned is not None:
            pinned.release()

    def commit(self, version: int, lineage: str) -> bool:
        """The round of `version` committed: its staging copy becomes the held version."""
        staging, failed = self._staging, self._staging_failed
        if staging is None or staging.version != version:
            return False
        if failed or not staging.complete:
            log.warning("holder: version %d committed but its staging copy is incomplete", version)
            self.abandon()
            return False
        staging.lineage = lineage
        old, self._held, self._staging = self._held, staging, None
        if old is not None:
            self._free.append(old.buffer)
        self._metrics.held_version.set(version)
        log.info("holder: holding version %d (%d B)", version, staging.layout.total_bytes)
        return True

    def abandon(self) -> None:
        """The round failed: drop its staging copy; the held version stays as it was."""
        if self._staging is not None:
            self._free.append(self._staging.buffer)
            self._staging = None
        self._staging_failed = False
        self._round = None

    def release(self) -> None:
        """Hold nothing: unregister and free both buffers."""
        copies = [c.buffer for c in (self._held, self._staging) if c is not None]
        for buffer in [*copies, *self._free]:
            self._unregister(buffer)
        self._held = self._staging = None
        self._free = []
        self._epoch += 1
        self._staging_failed = False
        self._round = None
        self._metrics.held_version.set(-1)

    async def holding(self) -> Holding | None:
        """What a puller needs to read the held version; None when nothing is held.
        Waits for the held version's checksums (a commit's last ones may still run)."""
        held = self._held
        if held is None or self._endpoint is None:
            return None
        futures = [asyncio.wrap_future(held.checksums[b.index]) for b in held.layout.buckets]
        checksums = await asyncio.wait_for(asyncio.gather(*futures), _HOLDING_WAIT_SECONDS)
        if self._held is not held:  # a newer version was committed meanwhile
            return await self.holding()
        return Holding(
            version=held.version,
            lineage=held.lineage,
            layout=held.layout.to_json(),
            layout_hash=held.layout.layout_hash,
            segment=self._endpoint.segment,
            address=held.buffer.data_ptr(),
            nbytes=held.layout.total_bytes,
            protocol=self.protocol,
            checksums=list(checksums),
        )

    @property
    def held(self) -> HostCopy | None:
        """The held version (its buffer may be longer than its layout's bytes)."""
        return self._held

    def close(self) -> None:
        self.pinning.resume()  # an allocation waiting for a round must not outlive us
        self.release()
        self._checksummer.shutdown(wait=False, cancel_futures=True)
