"""Device-to-host copies for the holder, on one side stream of the agent's GPU.

Two shapes: a slot's bytes right after its bucket went out (`after_current`: ordered
after the current stream's work, and the current stream waits for the copy before it
writes the slot again), and the Publisher's own tensors in bounded groups
(`copy_groups` + `queue`: the copy engine takes device-to-host copies in order, so a
round's small reads must not queue behind the whole model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from weightsync.transfer.held import held_checksum
from weightsync.transfer.layout import Bucket

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (host target, device source)


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
