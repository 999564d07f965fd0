"""Peer-to-peer pulls of a held weight version through the Mooncake transfer engine.

A *holder* keeps the latest committed version in host memory (pinned where CUDA
exists) registered with its transfer engine. A recovering agent registers its own
destination buffer and reads the bytes chunk by chunk from one or more holders:
RDMA in production, TCP where no RDMA NIC exists (as on CI machines). Segments are
found by Mooncake's P2P handshake, so no metadata server runs: a segment's name is
`<host>:<rpc port>`.

Chunks are striped over holders by work stealing (one reader thread per holder, one
shared queue), so a faster holder serves more and a holder that dies mid-pull just
stops taking chunks; its unfinished chunk goes back to the queue for the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.api.reasons import RecoveryFailureReason
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_IDLE_POLL_SECONDS = 0.005  # how often an idle reader looks for a chunk another one gave back


class P2PError(RuntimeError):
    """A pull or a registration failed; `reason` is a short metric label.

    A failed `pull` attaches its report, so the caller learns which holders failed.
    """

    def __init__(self, reason: str, message: str, report: PullReport | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.report = report


def mooncake_available() -> tuple[bool, str]:
    """Whether the Mooncake transfer engine loads here, and why not if it does not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as error:  # a missing libibverbs1 shows up here, too
        return False, str(error)
    return True, "mooncake transfer engine"


class TransferEngineEndpoint:
    """One process's Mooncake transfer engine: registers memory and reads peers' memory."""

    def __init__(self, host: str, protocol: RecoveryProtocol, device_names: str = "") -> None:
        ok, why = mooncake_available()
        if not ok:
            raise P2PError(
                RecoveryFailureReason.TRANSPORT_UNAVAILABLE,
                f"Mooncake transfer engine unavailable: {why}",
            )
        from mooncake.engine import TransferEngine

        self._engine: Any = TransferEngine()
        code = self._engine.initialize(host, "P2PHANDSHAKE", protocol.value.lower(), device_names)
        if code != 0:
            raise P2PError(
                RecoveryFailureReason.INIT_FAILED,
                f"transfer engine init on {host} ({protocol}) -> {code}",
            )
        self.protocol = protocol
        self.segment = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # address -> registered bytes
        log.info("P2P transport: Mooncake %s, segment %s", protocol.value, self.segment)

    def register(self, tensor: torch.Tensor) -> None:
        """Make `tensor`'s memory readable by peers (holder) or writable by reads (puller).

        Registering a view of memory already registered at the same address is free; a
        larger region at that address replaces the smaller registration.
        """
        address = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        known = self._registered.get(address)
        if known is not None and known >= nbytes:
            return
        if known is not None:
            self._engine.unregister_memory(address)
            del self._registered[address]
        code = self._engine.register_memory(address, nbytes)
        if code != 0:
            raise P2PError(
                RecoveryFailureReason.REGISTER_FAILED, f"register_memory({address:#x}) -> {code}"
            )
        self._registered[address] = nbytes

    def unregister(self, tensor: torch.Tensor) -> None:
        address = tensor.data_ptr()
        if self._registered.pop(address, None) is not None:
            self._engine.unregister_memory(address)

    def read(self, segment: str, local_address: int, remote_address: int, nbytes: int) -> None:
        """Copy `nbytes` from a peer's registered memory into ours; raises on failure."""
        code = self._engine.transfer_sync_read(segment, local_address, remote_address, nbytes)
        if code < 0:
            raise P2PError(
                RecoveryFailureReason.READ_FAILED, f"read of {nbytes} B from {segment} -> {code}"
            )

    def close(self) -> None:
        for address in list(self._registered):
            self._engine.unregister_memory(address)
        self._registered.clear()


@dataclass(frozen=True, slots=True)
class HeldRegion:
    """A holder's copy of one version, as a puller addresses it."""

    name: str  # the holder (a pod name), for reports and logs
    segment: str
    address: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """A byte range of the version (a bucket) and, optionally, its expected checksum."""

    offset: int
    nbytes: int
    checksum: int | None = None


@dataclass
class PullReport:
    bytes: int
    seconds: float
    bytes_by_holder: dict[str, int] = field(default_factory=dict)
    failed_holders: dict[str, str] = field(default_factory=dict)  # name -> why

    @property
    def bandwidth_bytes_per_second(self) -> int:
        return int(self.bytes / self.seconds) if self.seconds > 0 else 0


def _read_chunk(
    endpoint: TransferEngineEndpoint,
    holder: HeldRegion,
    chunk: Chunk,
    target: torch.Tensor,
    checksum: Callable[[torch.Tensor], int] | None,
) -> P2PError | None:
    """Read one chunk from one holder; the error if the read or its checksum failed."""
    try:
        endpoint.read(
            holder.segment, target.data_ptr(), holder.address + chunk.offset, chunk.nbytes
        )
    except P2PError as error:
        return error
    if checksum is not None and chunk.checksum is not None:
        found = checksum(target)
        if found != chunk.checksum:
            return P2PError(
                RecoveryFailureReason.CHECKSUM_MISMATCH,
                f"chunk at {chunk.offset}: checksum {found} != {chunk.checksum}",
            )
    return None


def _check_pull(
    holders: Sequence[HeldRegion], chunks: Sequence[Chunk], destination: torch.Tensor
) -> None:
    if not holders:
        raise P2PError(RecoveryFailureReason.NO_HOLDER, "no holder to pull from")
    end = max((c.offset + c.nbytes for c in chunks), default=0)
    for holder in holders:
        if holder.nbytes < end:
            raise P2PError(
                RecoveryFailureReason.HOLDER_TOO_SMALL,
                f"{holder.name} holds {holder.nbytes} B, need {end}",
            )
    if destination.dim() != 1 or destination.element_size() != 1 or not destination.is_contiguous():
        raise P2PError(
            RecoveryFailureReason.BAD_DESTINATION,
            "the destination must be a contiguous 1-D byte tensor",
        )
    if destination.numel() < end:
        raise P2PError(
            RecoveryFailureReason.DESTINATION_TOO_SMALL,
            f"destination holds {destination.numel()} B, need {end}",
        )


class _Readers:
    """The shared state of one pull: a queue of chunks and one reader thread per holder.

    A reader stays until every chunk is done, not just until the queue is empty: a chunk
    that another holder failed on comes back to the queue and must find a taker.
    """

    def __init__(
        self,
        endpoint: TransferEngineEndpoint,
        chunks: Sequence[Chunk],
        holders: Sequence[HeldRegion],
        destination: torch.Tensor,
        *,
        checksum: Callable[[torch.Tensor], int] | None,
        deadline: float,
    ) -> None:
        self.endpoint = endpoint
        self.destination = destination
        self.checksum = checksum
        self.deadline = deadline
        self.pending: queue.Queue[Chunk] = queue.Queue()
        for chunk in chunks:
            self.pending.put(chunk)
        self.report = PullReport(bytes=sum(c.nbytes for c in chunks), seconds=0.0)
        self.lock = threading.Lock()
        self.remaining = len(chunks)  # chunks not yet read
        self.live = len(holders)  # readers neither finished nor dropped
        self.all_done = threading.Event()
        if not chunks:
            self.all_done.set()

    def serve(self, holder: HeldRegion) -> None:
        moved = 0
        while not self.all_done.is_set() and time.monotonic() < self.deadline:
            try:
                chunk = self.pending.get(timeout=_IDLE_POLL_SECONDS)
            except queue.Empty:
                continue
            target = self.destination[chunk.offset : chunk.offset + chunk.nbytes]
            failure = _read_chunk(self.endpoint, holder, chunk, target, self.checksum)
            if failure is not None:
                self.pending.put(chunk)  # another holder reads it again
                with self.lock:
                    self.report.failed_holders[holder.name] = f"{failure.reason}: {failure}"
                log.warning("holder %s dropped from the pull: %s", holder.name, failure)
                break
            moved += chunk.nbytes
            with self.lock:
                self.remaining -= 1
                if self.remaining == 0:
                    self.all_done.set()
        with self.lock:
            self.report.bytes_by_holder[holder.name] = moved
            self.live -= 1
            if self.live == 0:
                self.all_done.set()  # nobody is left to read what is still queued


def pull(
    endpoint: TransferEngineEndpoint,
    holders: Sequence[HeldRegion],
    chunks: Sequence[Chunk],
    destination: torch.Tensor,
    *,
    checksum: Callable[[torch.Tensor], int] | None = None,
    timeout_seconds: float = 600.0,
) -> PullReport:
    """Read every chunk into `destination` (at the chunk's offset) from the holders.

    A holder whose read fails, or whose bytes fail a chunk's checksum, is dropped and
    the chunk is read again from another holder. Raises `P2PError` when no holder is
    left or the pull outlives `timeout_seconds`.
    """
    _check_pull(holders, chunks, destination)
    endpoint.register(destination)
    deadline = time.monotonic() + timeout_seconds
    readers = _Readers(endpoint, chunks, holders, destination, checksum=checksum, deadline=deadline)
    started = time.monotonic()
    # Daemon threads: a read stuck inside the transfer engine must not keep the agent alive.
    threads = [
        threading.Thread(target=readers.serve, args=(h,), name=f"pull-{h.name}", daemon=True)
        for h in holders
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
    report = readers.report
    report.seconds = time.monotonic() - started
    pulled = sum(report.bytes_by_holder.values())
    if pulled != report.bytes:
        why = "; ".join(f"{k}: {v}" for k, v in report.failed_holders.items()) or "timed out"
        reason = (
            RecoveryFailureReason.TIMEOUT
            if time.monotonic() >= deadline
            else RecoveryFailureReason.NO_LIVE_HOLDER
        )
        raise P2PError(reason, f"pulled {pulled} of {report.bytes} B ({why})", report)
    return report


class Endpoints:
    """This process's transfer engines, one per protocol, made on first use.

    A holder and a recovery in the same agent share them, so memory is registered with
    one engine per protocol and peers find one segment per protocol. `host` is resolved
    on first use (it may need a DNS lookup of the pod's own name).
    """

    def __init__(self, host: Callable[[], str], device_names: str = "") -> None:
        self._host = host
        self.device_names = device_names
        self._by_protocol: dict[RecoveryProtocol, TransferEngineEndpoint] = {}
        self._lock = threading.Lock()

    def get(self, protocol: RecoveryProtocol) -> TransferEngineEndpoint:
        """The endpoint for `protocol`; blocks while the engine starts (call off the loop)."""
        with self._lock:
            endpoint = self._by_protocol.get(protocol)
            if endpoint is None:
                endpoint = TransferEngineEndpoint(self._host(), protocol, self.device_names)
                self._by_protocol[protocol] = endpoint
            return endpoint

    def close(self) -> None:
        with self._lock:
            for endpoint in self._by_protocol.values():
                endpoint.close()
            self._by_protocol.clear()
