"""Device-to-host copies for the holder, on one side stream of the agent's GPU.

Two shapes: a slot's bytes right after its bucket went out (`after_current`: ordered
after the current stream's work, and the current stream waits for the copy before it
writes the slot again), and the Publisher's own tensors in bounded groups
(`copy_groups` + `queue`: the copy engine takes device-to-host copies in order, so a
round's small reads must not queue behind the whole model), paused while the round votes
(`VoteGate`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch

from weightsync.transfer.held import held_checksum
from weightsync.transfer.layout import Bucket

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (host target, device source)


class VoteGate:
    """Closed by a round across its fail-together votes; the holder's copy of the
    Publisher's tensors waits at it before queueing more (event-loop side only).

    Why: each vote reads its agreed flag back with a small device-to-host copy, and the
    held copy keeps the same direction of the copy engine busy for hundreds of ms, its
    queue refilled as it drains. Read behind that queue, a vote took up to ~25 ms (issue
    #40: 8B on H200s, bimodal rounds). Closed, the queue runs dry (at most
    `_HOLD_QUEUE_BYTES` plus a group, ~2 ms of PCIe) while the sinks reach the vote, and
    the flag is read on an idle engine; the copy resumes once the round's votes are over.
    The held copy is only paused, never cut short: fences and checksums are unchanged.
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled  # off: for measuring only (the benchmark's A/B)
        self._voting = 0  # rounds (nested holds) voting now
        self._open = asyncio.Event()
        self._open.set()

    @property
    def closed(self) -> bool:
        return self._voting > 0

    @contextlib.contextmanager
    def voting(self) -> Iterator[None]:
        """Held by a round from just before its first vote to the end of its last."""
        if not self.enabled:
            yield
            return
        self._voting += 1
        self._open.clear()
        try:
            yield
        finally:
            self._voting -= 1
            if self._voting == 0:
                self._open.set()

    async def passed(self) -> None:
        """Return once no round is voting (at once when none is)."""
        while self._voting:
            await self._open.wait()


class CopyStream(Protocol):
    def queue(self, group: Pairs) -> torch.cuda.Event: ...


class CopyQueue:
    """Groups of copies queued on `stream`, at most about `limit` bytes at a time, and
    none while a round votes (`gate`): the queue stays short enough that a vote's flag
    read waits for little, and runs dry while the round votes."""

    def __init__(self, stream: CopyStream, gate: VoteGate, limit: int) -> None:
        self._stream = stream
        self._gate = gate
        self._limit = limit
        self._queued: deque[tuple[torch.cuda.Event, int]] = deque()
        self._bytes = 0  # of `_queued`

    async def put(self, group: Pairs) -> torch.cuda.Event:
        """Queue `group` once no round votes; its done event. Returns once at most
        `limit` bytes are queued."""
        await self._gate.passed()
        done = await asyncio.to_thread(self._stream.queue, group)
        nbytes = sum(target.nbytes for target, _ in group)
        self._queued.append((done, nbytes))
        self._bytes += nbytes
        while self._bytes > self._limit:
            event, nbytes = self._queued.popleft()
            await asyncio.to_thread(event.synchronize)
            self._bytes -= nbytes
        return done

    async def drain(self) -> None:
        """Return once every queued copy is done."""
        if self._queued:
            await asyncio.to_thread(self._queued[-1][0].synchronize)
        self._queued.clear()
        self._bytes = 0


class SideStream:
    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self._stream

    def queue(self, group: Pairs) -> torch.cuda.Event:
        """Queue `group`'s copies; their done event. The sources are complete: the
        Publisher synchronised its device before the round."""
        side = self._side(group[0][1].device)
        with torch.cuda.stream(side):
            for target, source in group:
                target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        return done

    def after_current(self, pairs: Pairs) -> torch.cuda.Event:
        """Copy `pairs` once the current stream wrote their sources; the current stream
        then waits for the copies (the next write into that slot is ordered after them)."""
        device = pairs[0][1].device
        current = torch.cuda.current_stream(device)
        side = self._side(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        current.wait_event(done)
        return done


def within_slices(
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], origin: int, slice_bytes: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) as byte pieces whose targets never cross a multiple of
    `slice_bytes` from `origin`: a copy into host memory registered in slices must stay
    inside one registration (the driver refuses one that crosses, `invalid argument`).
    Both sides contiguous."""
    pieces = []
    for target, source in pairs:
        t = target.reshape(-1).view(torch.uint8)
        s = source.reshape(-1).view(torch.uint8)
        at, address = 0, t.data_ptr()
        while at < t.numel():
            room = slice_bytes - (address + at - origin) % slice_bytes
            step = min(room, t.numel() - at)
            pieces.append((t[at : at + step], s[at : at + step]))
            at += step
    return pieces


def copy_groups(
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


def checksum_after(done: torch.cuda.Event, target: torch.Tensor, bucket: Bucket) -> int:
    done.synchronize()
    return held_checksum(target, bucket)
