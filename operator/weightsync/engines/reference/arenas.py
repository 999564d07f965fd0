"""The reference engine's staging arenas and the validated bucket plans that key them
(the design is in `engine`'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.transfer.buffers import BucketSlots
from weightsync.transfer.layout import TensorSlice


@dataclass(frozen=True, slots=True, eq=False)
class BucketPlan:
    """A validated bucket: where its tensors lie in a slot and in a staging arena.

    Plans are cached and compared by identity, so they key the arenas cheaply.
    """

    tensors: tuple[TensorSlice, ...]
    start: int  # the slot's bytes [start, end) hold the bucket
    end: int
    dense: bool  # one copy of [start, end) moves the bucket
    arena_offsets: tuple[int, ...]
    arena_bytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(eq=False)
class Arena:
    """One bucket's staging (later served) bytes, and each tensor's view into them."""

    id: int
    buffer: torch.Tensor  # 1-D uint8 on the engine's device
    views: dict[str, torch.Tensor]
    shared: BucketSlots | None = None  # a CPU arena's shared memory, unlinked when dropped

    def copies(self, plan: BucketPlan) -> list[tuple[int, int, int]]:
        """(slot offset, arena offset, bytes) spans that fill this arena from a slot."""
        if plan.dense:
            return [(plan.start, 0, plan.arena_bytes)]
        return [
            (item.offset, at, item.nbytes)
            for item, at in zip(plan.tensors, plan.arena_offsets, strict=True)
        ]

    def release(self) -> None:
        if self.shared is not None:
            self.shared.close()


@dataclass
class UpdateStats:
    """What one update cost inside the engine; logged when it commits or aborts."""

    loads: int = 0
    bytes: int = 0
    load_seconds: float = 0.0
    longest_load_seconds: float = 0.0
    allocated_bytes: int = 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.loads += 1
        self.bytes += nbytes
        self.load_seconds += seconds
        self.longest_load_seconds = max(self.longest_load_seconds, seconds)
