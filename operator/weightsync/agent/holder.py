"""The holder: the latest committed version in host memory, for P2P recovery pulls.

A holder keeps one contiguous host buffer per version, laid out like the rounds'
buckets (bucket b at `held_offsets(layout)[b]`), registered once with its Mooncake
endpoint. Peers read it passively through the transfer engine; nothing here runs for
a pull.

It is filled *while the round runs*. A source agent that maps the Publisher's tensors
(GPU) calls `stage_tensors` once per round: every tensor is copied device-to-host on a
side stream beside the broadcast, and the round's result waits for it (the trainer may
write its tensors once `publish` returns). Otherwise the round calls `stage` once per
bucket, right after the bucket was broadcast (source) or received (sink), and the
bucket's bytes are copied out of the slot before the slot is reused:
* on GPU, a non-blocking D2H copy into pinned memory on a side stream; the device's
  current stream then waits for it (so the next receive into that slot is ordered after
  it), and `stage` keeps at most `depth - 1` copies in flight on the host side (the
  source's Publisher refills a slot from another process, which no stream orders);
* on CPU, a plain copy (in a worker thread, off the event loop).
Each bucket's checksum (`held_checksum`, CRC-32 over the held host bytes of its tensors,
so it is what a puller reads; the alignment padding between tensors is left out, since
holders fill it differently) is computed by a background thread, off the round's path.

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
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from weightsync.agent.metrics import AgentMetrics
from weightsync.api.control import Holding
from weightsync.api.v1alpha1.spec import RecoveryProtocol
from weightsync.transfer.buffers import copy_tensors, slot_views
from weightsync.transfer.held import held_checksum, held_offsets
from weightsync.transfer.layout import Bucket, BucketLayout
from weightsync.transfer.p2p import Endpoints, P2PError, TransferEngineEndpoint

log = logging.getLogger(__name__)

_HOLDING_WAIT_SECONDS = 60.0  # how long GET /v1/holding waits for a fresh commit's checksums
_HOLD_QUEUE_BYTES = 64 << 20  # device-to-host bytes `stage_tensors` keeps queued at most


@dataclass(eq=False)
class _HostCopy:
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
    ) -> None:
        self.device = device
        self.protocol = protocol
        self._endpoints = endpoints
        self._metrics = metrics
        self._enabled = enabled
        self._endpoint: TransferEngineEndpoint | None = None
        self._held: _HostCopy | None = None
        self._staging: _HostCopy | None = None
        self._staging_failed = False  # a copy of this round failed: never commit it
        self._spare: torch.Tensor | None = None  # a registered buffer neither held nor staging
        self._in_flight: deque[torch.cuda.Event] = deque()
        self._side_stream: torch.cuda.Stream | None = None
        self._checksummer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="holder-crc")

    # ------------------------------------------------------------------ state
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

    # ------------------------------------------------------------------ the round's hook
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
        staging = self._staging
        if (
            staging is None
            or bucket.index == 0
            or staging.version != version
            or staging.layout.layout_hash != layout.layout_hash
        ):
            staging = await self._begin(version, layout)
        if self._staging_failed:
            return
        offset = staging.offsets[bucket.index]
        target = staging.buffer[offset : offset + bucket.nbytes]
        source = slot[: bucket.nbytes]
        if source.is_cuda:
            done = self._copy_on_side_stream(target, source)
            self._in_flight.append(done)
            staging.checksums[bucket.index] = self._checksummer.submit(
                _checksum_after, done, target, bucket
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
        `_HOLD_QUEUE_BYTES` are queued at a time: the GPU's copy engine takes
        device-to-host copies in order, and the round's own small reads (the votes'
        flags) must not wait behind the whole model. The caller keeps the tensors
        unwritten until this returns. Never raises, as `stage`.
        """
        if not self._enabled:
            return
        try:
            staging = await self._begin(version, layout)
            queued: deque[tuple[torch.cuda.Event, int]] = deque()
            in_flight = 0  # bytes of `queued`
            for bucket in layout.buckets:
                at = staging.offsets[bucket.index]
                region = staging.buffer[at : at + bucket.nbytes]
                targets = slot_views(region, bucket.tensors)
                sources = [tensors[t.name] for t in bucket.tensors]
                if not (sources and sources[0].is_cuda):
                    await asyncio.to_thread(copy_tensors, targets, sources)
                    staging.checksums[bucket.index] = self._checksummer.submit(
                        held_checksum, region, bucket
                    )
                    continue
                done = None
                for group in _copy_groups(targets, sources, _HOLD_QUEUE_BYTES // 2):
                    done = await asyncio.to_thread(self._copies_on_side_stream, group)
                    queued.append((done, sum(t.nbytes for t, _ in group)))
                    in_flight += queued[-1][1]
                    while in_flight > _HOLD_QUEUE_BYTES:
                        event, nbytes = queued.popleft()
                        await asyncio.to_thread(event.synchronize)
                        in_flight -= nbytes
                if done is not None:
                    staging.checksums[bucket.index] = self._checksummer.submit(
                        _checksum_after, done, region, bucket
                    )
            if queued:
                await asyncio.to_thread(queued[-1][0].synchronize)
        except (P2PError, RuntimeError, MemoryError, OSError, KeyError) as exc:
            log.warning("holder: staging version %d from its tensors failed: %s", version, exc)
            self._staging_failed = True

    def _copies_on_side_stream(
        self, group: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.cuda.Event:
        """Queue device-to-host copies on the side stream; their done event. The sources
        are complete: the Publisher synchronised its device before the round."""
        device = group[0][1].device
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self._side_stream):
            for target, source in group:
                target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._side_stream)
        return done

    def _copy_on_side_stream(self, target: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event:
        current = torch.cuda.current_stream(source.device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(source.device)  # type: ignore[no-untyped-call]
        side = self._side_stream
        side.wait_stream(current)  # the bucket's bytes are complete on the current stream
        with torch.cuda.stream(side):
            target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        current.wait_event(done)  # the next write into this slot on this device waits
        return done

    async def _begin(self, version: int, layout: BucketLayout) -> _HostCopy:
        """A fresh staging copy for `version`, in the spare buffer (allocated if too small)."""
        if self._staging is not None:
            self._spare = self._staging.buffer
            self._staging = None
        self._staging_failed = False
        self._in_flight.clear()
        need = max(layout.total_bytes, 1)
        buffer = self._spare
        if buffer is None or buffer.numel() < need:
            self._spare = None
            if buffer is not None and self._endpoint is not None:
                self._endpoint.unregister(buffer)
            buffer = await asyncio.to_thread(self._allocate, need)
        self._spare = None
        self._staging = _HostCopy(buffer, version, layout, held_offsets(layout))
        return self._staging

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A registered host buffer (pinned for a GPU agent); runs off the event loop."""
        if self._endpoint is None:
            self._endpoint = self._endpoints.get(self.protocol)
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._endpoint.register(buffer)
        log.info("holder: registered %d B of host memory", nbytes)
        return buffer

    # ------------------------------------------------------------------ round outcome
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
            self._spare = old.buffer
        self._metrics.held_version.set(version)
        log.info("holder: holding version %d (%d B)", version, staging.layout.total_bytes)
        return True

    def abandon(self) -> None:
        """The round failed: drop its staging copy; the held version stays as it was."""
        if self._staging is not None:
            self._spare = self._staging.buffer
            self._staging = None
        self._staging_failed = False

    def release(self) -> None:
        """Hold nothing: unregister and free both buffers."""
        buffers: Sequence[torch.Tensor | None] = (
            self._held.buffer if self._held is not None else None,
            self._staging.buffer if self._staging is not None else None,
            self._spare,
        )
        if self._endpoint is not None:
            for buffer in buffers:
                if buffer is not None:
                    self._endpoint.unregister(buffer)
        self._held = self._staging = None
        self._spare = None
        self._staging_failed = False
        self._metrics.held_version.set(-1)

    # ------------------------------------------------------------------ serving
    async def holding(self) -> Holding | None:
        """What a puller needs to read the held version; None when nothing is held.

        Waits for the held version's checksums (a commit's last ones may still run).
        """
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

    def held_bytes(self) -> torch.Tensor | None:
        """The held version's bytes (a view; for tests and diagnostics)."""
        held = self._held
        return None if held is None else held.buffer[: held.layout.total_bytes]

    def close(self) -> None:
        self.release()
        self._checksummer.shutdown(wait=False, cancel_futures=True)


def _copy_groups(
    targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], chunk: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """(target, source) pieces in groups of about `chunk` bytes: large tensors split into
    flat pieces of `chunk` bytes, small ones gathered into one group."""
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    size = 0
    for target, source in zip(targets, sources, strict=True):
        flat_target, flat_source = target.reshape(-1), source.reshape(-1)
        step = max(chunk // max(target.element_size(), 1), 1)
        for start in range(0, max(flat_target.numel(), 1), step):
            piece = (flat_target[start : start + step], flat_source[start : start + step])
            if size and size + piece[0].nbytes > chunk:
                groups.append([])
                size = 0
            groups[-1].append(piece)
            size += piece[0].nbytes
    return [g for g in groups if g]


def _checksum_after(done: torch.cuda.Event, target: torch.Tensor, bucket: Bucket) -> int:
    done.synchronize()
    return held_checksum(target, bucket)
