"""The agent's bucket slots: the buffers a round's buckets pass through.

A sink whose engine runs on several devices (a tensor-parallel engine: one worker per
GPU, each reading only the copy on its own GPU) keeps `depth` slots on every one of
them. A round receives into the first device's slots (one rank per agent, whatever the
engine's size), then `replicate` copies each bucket's bytes device to device into the
same slot on the others before the engine is asked to load it. On CPU the copies are
distinct shared-memory slots (the reference engine's workers, in CI).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from weightsync.api.reasons import FailureReason
from weightsync.transfer.broadcast import TransferError
from weightsync.transfer.buffers import BucketSlots, SlotError
from weightsync.transfer.layout import BucketLayout


def slot_devices(device: str, engine_devices: int | None, visible_gpus: int) -> list[torch.device]:
    """The devices a sink keeps slots on: `device` (where rounds land) first, then the
    engine's other devices. Unset `engine_devices`: every visible GPU from `device` on
    (the sidecar sees exactly its engine's GPUs), one copy on CPU. Raises `SlotError`
    when fewer GPUs are visible than asked for."""
    first = torch.device(device)
    if first.type != "cuda":
        return [first] * (engine_devices or 1)
    index = first.index or 0
    available = visible_gpus - index
    count = available if engine_devices is None else engine_devices
    if count < 1 or count > available:
        raise SlotError(
            f"the engine's {count} GPU(s) from {first}: this container sees {visible_gpus}; "
            "the sidecar is given its engine's GPUs through the ResourceClaims the engine "
            "container names"
        )
    return [torch.device("cuda", index + i) for i in range(count)]


class Replica:
    """One bucket's copies on their way to the engine's other devices."""

    def __init__(
        self, events: Sequence[torch.cuda.Event] = (), future: Future[None] | None = None
    ) -> None:
        self._events = events
        self._future = future

    async def wait(self) -> None:
        """Return once every copy is complete (the engine may read them)."""
        try:
            if self._future is not None:
                await asyncio.wrap_future(self._future)
            for event in self._events:
                if not event.query():  # type: ignore[no-untyped-call]
                    await asyncio.to_thread(event.synchronize)
        except RuntimeError as exc:
            raise TransferError(
                FailureReason.REPLICA_FAILED, f"copying a bucket to a device: {exc}"
            ) from exc


_DONE = Replica()


class SlotPool:
    """The agent's bucket slots on each of `devices`, reallocated only when a layout needs
    more capacity. `devices[0]` receives; the others hold copies for the engine."""

    def __init__(self, devices: Sequence[torch.device], shm_dir: str) -> None:
        if not devices:
            raise SlotError("a slot pool needs at least one device")
        self.devices = list(devices)
        self.device = self.devices[0]
        self.shm_dir = shm_dir
        self.slots: BucketSlots | None = None
        self.copies: list[BucketSlots] = []  # on devices[1:], in that order
        self.epoch = 0  # bumps on reallocation; consumers re-attach when it changes
        self.engine_epoch = 0  # bumps when the slots or their copies change (an engine's)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # one per target device
        self._copier: ThreadPoolExecutor | None = None

    @property
    def copy_count(self) -> int:
        """How many copies of each slot the engine reads from (one per device)."""
        return len(self.devices)

    def fits(self, layout: BucketLayout, depth: int, staging_bytes: int = 0) -> bool:
        """Whether the current slots serve `layout` (`ensure` would keep them)."""
        current = self.slots
        needed = layout.capacity_bytes + staging_bytes
        return current is not None and current.capacity >= needed and len(current.slots) == depth

    def ensure(self, layout: BucketLayout, depth: int, staging_bytes: int = 0) -> BucketSlots:
        """Slots for `layout`, each with `staging_bytes` after the bucket's own bytes (where
        a sharded round's staged pieces land: `transfer.assembly.SlotRoutes`). Returns the
        receiving device's slots; the copies are reallocated with them, at the same size
        (an engine reads every copy of a slot as one)."""
        current = self.slots
        if current is not None and self.fits(layout, depth, staging_bytes):
            return current
        return self._allocate(layout.capacity_bytes + staging_bytes, depth)

    def reserve(self, capacity: int, depth: int) -> None:
        """Slots of at least `capacity` bytes before any layout is known (a generation's
        bucket size, at pre-warm): a layout within it keeps them (`fits`)."""
        current = self.slots
        if current is None or current.capacity < capacity or len(current.slots) != depth:
            self._allocate(capacity, depth)

    def _allocate(self, needed: int, depth: int) -> BucketSlots:
        self._release()
        allocated: list[BucketSlots] = []
        try:  # extend keeps what was allocated before a failure, to be closed
            allocated.extend(BucketSlots(depth, needed, d, self.shm_dir) for d in self.devices)
        except BaseException:
            for slots in allocated:
                slots.close()
            raise
        self.slots, self.copies = allocated[0], allocated[1:]
        self.epoch += 1
        self.engine_epoch += 1
        return self.slots

    def use_devices(self, devices: Sequence[torch.device]) -> None:
        """Keep the copies on `devices[1:]` from now on; `devices[0]` must be the
        receiving device, whose slots stay as they are (whoever maps them keeps them).
        A Colocated lead learns from its plan that its engine spans its source ranks'
        devices."""
        if list(devices) == self.devices:
            return
        if not devices or devices[0] != self.device:
            raise SlotError(f"the copies of the slots on {self.device} cannot start at {devices}")
        for copy in self.copies:
            copy.close()
        self.devices, self.copies = [self.device], []
        self.engine_epoch += 1
        copies: list[BucketSlots] = []
        current = self.slots
        try:
            if current is not None:
                depth, capacity = len(current.slots), current.capacity
                copies.extend(BucketSlots(depth, capacity, d, self.shm_dir) for d in devices[1:])
        except BaseException:
            for copy in copies:
                copy.close()
            raise
        self.devices, self.copies = list(devices), copies

    def engine_slots(self) -> list[torch.Tensor]:
        """Every copy of every slot, grouped by device in `devices` order, each group in
        slot order: what `attach_buffers` takes, with `copies=copy_count`."""
        if self.slots is None:
            raise SlotError("no slots allocated yet")
        return [slot for group in (self.slots, *self.copies) for slot in group.slots]

    def replicate(self, slot: int, nbytes: int) -> Replica:
        """Start copying bytes [0, nbytes) of receiving slot `slot` into that slot's copy on
        every other device; the returned `Replica` says when they are complete.

        On GPU each copy runs on a stream of its own (the copies to several GPUs go over
        their own links at once), ordered after the work the current stream has queued on
        the slot (its receive); the current stream then waits for them, so the next
        receive into the slot never overwrites bytes still being copied. On CPU the copy
        runs on a thread; wait for the replica before reusing the slot."""
        if not self.copies or nbytes == 0:
            return _DONE
        if self.slots is None:
            raise SlotError("no slots allocated yet")
        source = self.slots.slots[slot][:nbytes]
        targets = [copy.slots[slot][:nbytes] for copy in self.copies]
        if not source.is_cuda:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(1, thread_name_prefix="slot-replica")
            return Replica(future=self._copier.submit(_copy_all, targets, source))
        current = torch.cuda.current_stream(source.device)
        events = []
        for target in targets:
            stream = self._stream(target.device, source.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            current.wait_event(done)
            events.append(done)
        return Replica(events=events)

    def _stream(self, target: torch.device, source: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(target)
        if stream is None:
            stream = self._streams[target] = torch.cuda.Stream(source)  # type: ignore[no-untyped-call]
        return stream

    def _release(self) -> None:
        for slots in (self.slots, *self.copies):
            if slots is not None:
                slots.close()
        self.slots, self.copies = None, []

    def close(self) -> None:
        self._release()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None


def _copy_all(targets: Sequence[torch.Tensor], source: torch.Tensor) -> None:
    for target in targets:
        target.copy_(source)
