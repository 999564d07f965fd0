"""The agent's bucket slots: the buffers a round's buckets pass through."""

from __future__ import annotations

import torch

from weightsync.transfer.buffers import BucketSlots
from weightsync.transfer.layout import BucketLayout


class SlotPool:
    """The agent's bucket slots, reallocated only when a layout needs more capacity."""

    def __init__(self, device: torch.device, shm_dir: str) -> None:
        self.device = device
        self.shm_dir = shm_dir
        self.slots: BucketSlots | None = None
        self.epoch = 0  # bumps on reallocation; consumers re-attach when it changes

    def fits(self, layout: BucketLayout, depth: int, staging_bytes: int = 0) -> bool:
        """Whether the current slots serve `layout` (`ensure` would keep them)."""
        current = self.slots
        needed = layout.capacity_bytes + staging_bytes
        return current is not None and current.capacity >= needed and len(current.slots) == depth

    def ensure(self, layout: BucketLayout, depth: int, staging_bytes: int = 0) -> BucketSlots:
        """Slots for `layout`, each with `staging_bytes` after the bucket's own bytes (where
        a sharded round's staged pieces land: `transfer.assembly.SlotRoutes`)."""
        current = self.slots
        if current is not None and self.fits(layout, depth, staging_bytes):
            return current
        if current is not None:
            current.close()
        needed = layout.capacity_bytes + staging_bytes
        self.slots = BucketSlots(depth, needed, self.device, self.shm_dir)
        self.epoch += 1
        return self.slots

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None
