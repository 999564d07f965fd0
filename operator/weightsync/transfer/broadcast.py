"""Bucket transports: how bucket bytes get from the source's slot into every sink's slot.

* `BroadcastTransport`: one c10d broadcast per bucket from the source rank over a
  generation's process group (NCCL between GPUs, gloo on CPU).
* `LocalTransport`: no peers (Colocated mode): the bytes are already where the engine
  reads them, the source agent's own slots, shared by CUDA IPC or shared memory.

Every wait has a deadline: `wait` polls `Work.is_completed()` rather than blocking in
the backend, and meanwhile checks the generation's failure key, so one rank's failure
stops the others well before their timeout. A bucket of 512 MiB is on an NVLink wire for
about 1.5 ms, so the poll is fine-grained at first (completion is seen within ~0.1 ms;
an exponential back-off to 2 ms used to add up to 1.6 ms to every bucket) and backs off
only once a wait has lasted far longer than any healthy bucket.
"""

from __future__ import annotations

import abc
import ctypes
import functools
import logging
import time
import zlib
from collections.abc import Sequence
from typing import ClassVar, Protocol, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllreduceOptions,
    BroadcastOptions,
    ReduceOp,
    Store,
)
from torch._C._distributed_c10d import Backend as C10dBackend

from weightsync.api.control import Backend
from weightsync.api.reasons import FailureReason
from weightsync.transfer.layout import Bucket

log = logging.getLogger(__name__)

_FAILURE_POLL_SECONDS = 0.1
_FAST_POLL_SECONDS = 2e-5  # the kernel's timer slack makes this ~60-100 us in practice
_FAST_POLL_WINDOW_SECONDS = 0.05  # then back off: a wait this long is a slow or hung peer
_SLOW_POLL_SECONDS = 2e-3


class Collectives(Protocol):
    """The c10d backend methods used here (torch's stubs for `Backend` lack them)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work: ...
    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work: ...
    def barrier(self, opts: dist.BarrierOptions) -> dist.Work: ...
    def abort(self) -> None: ...
    def shutdown(self) -> None: ...
    @property
    def supports_coalescing(self) -> bool: ...
    def _start_coalescing(self) -> None: ...
    def _end_coalescing(self) -> dist.Work: ...


class TransferError(RuntimeError):
    """A collective failed, timed out, or a peer reported failure; `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Transport(abc.ABC):
    """Moves a bucket from the source rank to all others; every call has a deadline."""

    name: ClassVar[str]

    @abc.abstractmethod
    def start_bucket(self, buffer: torch.Tensor, root: int = 0) -> dist.Work | None:
        """Issue the transfer of `buffer` (sent on rank `root`, a source; received elsewhere)."""

    @abc.abstractmethod
    def wait(self, pending: dist.Work | None, *, deadline: float, failure_key: str | None) -> None:
        """Return once `pending` is complete and its buffer may be read or reused."""

    def start_sends(self, sends: Sequence[tuple[int, torch.Tensor]]) -> list[dist.Work | None]:
        """Issue every transfer of one bucket, `(root, buffer)` each, in this order (the
        same on every rank): one call, so a bucket of many segments costs one hop to the
        collective thread, not one per segment."""
        return [self.start_bucket(buffer, root) for root, buffer in sends]

    def wait_all(
        self, pending: Sequence[dist.Work | None], *, deadline: float, failure_key: str | None
    ) -> None:
        """`wait` for each of `pending`."""
        for work in pending:
            self.wait(work, deadline=deadline, failure_key=failure_key)

    @abc.abstractmethod
    def agree_max(self, flag: int, *, deadline: float, failure_key: str | None) -> int:
        """The maximum of `flag` over all ranks (the fail-together vote)."""

    def abort(self) -> None:  # noqa: B027 - a transport without peers holds nothing
        """Abort in-flight work without waiting on peers."""


class LocalTransport(Transport):
    """No peers: the round's only rank is the source."""

    name = "local"

    def start_bucket(self, buffer: torch.Tensor, root: int = 0) -> dist.Work | None:
        return None

    def wait(self, pending: dist.Work | None, *, deadline: float, failure_key: str | None) -> None:
        return None

    def agree_max(self, flag: int, *, deadline: float, failure_key: str | None) -> int:
        return flag


class BroadcastTransport(Transport):
    """c10d broadcasts over one generation's process group, each from the source rank that
    owns the bytes (rank 0 when one source sends everything)."""

    name = "broadcast"

    def __init__(
        self,
        pg: C10dBackend,
        *,
        device: torch.device,
        ctl: Store,
    ) -> None:
        self._pg: Collectives | None = cast(Collectives, pg)
        self._device = device
        self._ctl = ctl
        self._vote: torch.Tensor | None = None

    @property
    def pg(self) -> Collectives:
        if self._pg is None:
            raise TransferError(FailureReason.ABORTED, "the process group was aborted")
        return self._pg

    def start_bucket(self, buffer: torch.Tensor, root: int = 0) -> dist.Work:
        opts = BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        return self.pg.broadcast([buffer], opts)

    def start_sends(self, sends: Sequence[tuple[int, torch.Tensor]]) -> list[dist.Work | None]:
        """A sharded bucket's segments (hundreds of small broadcasts from alternating roots)
        as one NCCL group: one launch, one completion, instead of a kernel and an event per
        segment. Gloo cannot coalesce broadcasts: they go one by one."""
        pg = self.pg
        if len(sends) < 2 or not pg.supports_coalescing:
            return super().start_sends(sends)
        pg._start_coalescing()
        try:
            for root, buffer in sends:
                self.start_bucket(buffer, root)
        finally:
            work = pg._end_coalescing()
        return [work]

    def wait(self, pending: dist.Work | None, *, deadline: float, failure_key: str | None) -> None:
        if pending is None:
            return
        started = time.monotonic()
        next_check = started + _FAILURE_POLL_SECONDS
        delay = _FAST_POLL_SECONDS
        while not pending.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise TransferError(FailureReason.TIMEOUT, "collective timed out")
            if failure_key is not None and now >= next_check:
                next_check = now + _FAILURE_POLL_SECONDS
                if self._ctl.check([failure_key]):
                    reason = self._ctl.get(failure_key).decode()
                    raise TransferError(
                        FailureReason.PEER_FAILED, f"a peer failed the round: {reason}"
                    )
            if now - started > _FAST_POLL_WINDOW_SECONDS:
                delay = min(delay * 2, _SLOW_POLL_SECONDS)
            time.sleep(delay)
        try:
            pending.wait()
        except (RuntimeError, dist.DistError) as exc:
            raise TransferError(
                FailureReason.COLLECTIVE_ERROR, f"collective failed: {exc}"
            ) from exc

    def agree_max(self, flag: int, *, deadline: float, failure_key: str | None) -> int:
        # A kernel fill instead of a host-to-device copy of a fresh tensor; one `.item()`
        # per vote is the only host sync a vote costs.
        vote = self._vote
        if vote is None:
            vote = self._vote = torch.zeros(1, dtype=torch.int32, device=self._device)
        vote.fill_(flag)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.MAX)
        self.wait(self.pg.allreduce([vote], opts), deadline=deadline, failure_key=failure_key)
        return int(vote.item())

    def barrier_blocking(self, *, deadline: float) -> None:
        """The warm-up barrier (with `device_ids` on NCCL, so it uses the right GPU)."""
        opts = dist.BarrierOptions()
        if self._device.type == "cuda":
            opts.device_ids = [self._device.index or 0]
        self.wait(self.pg.barrier(opts), deadline=deadline, failure_key=None)

    def abort(self) -> None:
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            pg.abort()
        except RuntimeError as exc:  # gloo may not abort; its sockets close with the group
            log.debug("backend abort unsupported: %s", exc)

    def shutdown(self) -> None:
        """Release a healthy group (NCCL communicators are destroyed, not aborted)."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            pg.shutdown()
        except RuntimeError as exc:
            log.warning("process group shutdown failed: %s", exc)


def backend_available(backend: Backend) -> bool:
    """Whether this process can use `backend` at all."""
    if backend == Backend.NCCL:
        return dist.is_nccl_available() and torch.cuda.is_available()
    return dist.is_gloo_available()


def resolve_backend(backend: Backend, device: torch.device) -> Backend:
    """Check the plan's backend against this process and the device; log the resolution."""
    if not backend_available(backend):
        raise TransferError(
            FailureReason.BACKEND_UNAVAILABLE, f"{backend.value} is not available here"
        )
    if (backend == Backend.NCCL) != (device.type == "cuda"):
        raise TransferError(
            FailureReason.BACKEND_DEVICE_MISMATCH,
            f"backend {backend.value} cannot move {device.type} buffers",
        )
    log.info("bucket transport: %s broadcast on %s", backend.value, device)
    return backend


def host_crc32(data: torch.Tensor, value: int = 0) -> int:
    """CRC-32 of a host tensor's bytes, continuing from `value` (read in place)."""
    data = data.contiguous().view(torch.uint8)
    if data.device.type != "cpu":
        raise ValueError("CRC-32 is taken over host memory")
    # ctypes instead of .numpy(): the bytes are read in place and numpy is optional.
    return zlib.crc32((ctypes.c_char * data.numel()).from_address(data.data_ptr()), value)


def bucket_checksum(buffer: torch.Tensor) -> int:
    """A per-bucket checksum: CRC-32 on CPU; on GPU a position-weighted sum, no host copy.

    The GPU sum catches corrupted or misplaced blocks (each 4 KiB row is weighted by its
    index), which is what a transfer can get wrong; it is not a cryptographic digest.
    """
    if buffer.device.type == "cpu":
        return host_crc32(buffer)
    words = buffer.view(torch.int64)
    rows = words.numel() // 512
    head, tail = words[: rows * 512].view(rows, 512), words[rows * 512 :]
    weights = torch.arange(1, rows + 1, dtype=torch.int64, device=buffer.device)
    total = head.sum(dim=1, dtype=torch.int64) * weights
    return int(total.sum().item()) ^ int(tail.sum().item()) ^ rows


def written_checksum(buffer: torch.Tensor, bucket: Bucket) -> int:
    """`bucket_checksum` of a bucket's slot with the alignment padding between its tensors
    zeroed first. A round writes only tensor bytes (sharded pieces land tensor by tensor),
    so the padding keeps whatever each rank's slot held before, which differs where an
    agent was replaced; zeroed, every rank sums the same bytes for the same tensors."""
    gaps = [buffer[start:end] for start, end in padding(bucket)]
    if gaps:
        torch._foreach_zero_(gaps)
    return bucket_checksum(buffer)


@functools.lru_cache(maxsize=4096)
def padding(bucket: Bucket) -> tuple[tuple[int, int], ...]:
    """The byte ranges of `bucket` that no tensor covers, in order."""
    gaps, at = [], 0
    for t in sorted(bucket.tensors, key=lambda t: t.offset):
        if t.offset > at:
            gaps.append((at, t.offset))
        at = max(at, t.offset + t.nbytes)
    if bucket.nbytes > at:
        gaps.append((at, bucket.nbytes))
    return tuple(gaps)
