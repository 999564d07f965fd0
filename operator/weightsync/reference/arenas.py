"""The reference engine's staging arenas and the validated bucket plans that key them
(the design is in `engine`'s docstring)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.engines.base import EngineError
from weightsync.transfer.buffers import BucketSlots, copy_tensors, dtype_name, torch_dtype
from weightsync.transfer.layout import DEFAULT_ALIGNMENT, TensorSlice, align_up


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
    commit_seconds: float = 0.0  # the parameters pointed at the new arenas

    def add(self, nbytes: int, seconds: float) -> None:
        self.loads += 1
        self.bytes += nbytes
        self.load_seconds += seconds
        self.longest_load_seconds = max(self.longest_load_seconds, seconds)

    def summary(self, version: int, outcome: str) -> str:
        """The update's one-line JSON summary (the benchmarks read it from the log)."""
        return (
            f'{{"version":{version},"outcome":"{outcome}","loads":{self.loads},'
            f'"bytes":{self.bytes},"load_ms":{self.load_seconds * 1000:.3f},'
            f'"longest_load_ms":{self.longest_load_seconds * 1000:.3f},'
            f'"allocated_bytes":{self.allocated_bytes},'
            f'"commit_ms":{self.commit_seconds * 1000:.3f}}}'
        )


# A bucket whose span in the slot exceeds its payload by more than this per tensor is
# copied tensor by tensor into a compact arena instead of as one span.
_DENSE_SLACK_BYTES = 1024


def make_plan(params: Mapping[str, torch.Tensor], tensors: tuple[TensorSlice, ...]) -> BucketPlan:
    """Check a bucket's tensors against the served parameters; where they go in an arena."""
    if not tensors:
        raise EngineError("bad_bucket", "a bucket holds at least one tensor")
    seen: set[str] = set()
    for item in tensors:
        param = params.get(item.name)
        if param is None:
            raise EngineError("unknown_tensor", f"no parameter named {item.name!r}")
        if tuple(param.shape) != item.shape or dtype_name(param.dtype) != item.dtype:
            raise EngineError(
                "tensor_mismatch",
                f"{item.name}: got {item.dtype}{list(item.shape)}, "
                f"serving {dtype_name(param.dtype)}{list(param.shape)}",
            )
        if item.nbytes != param.nbytes or item.offset < 0:
            raise EngineError("bad_bucket", f"{item.name}: {item.nbytes} B at offset {item.offset}")
        if item.offset % param.element_size():
            raise EngineError("bad_bucket", f"{item.name}: misaligned offset {item.offset}")
        if item.name in seen:
            raise EngineError("bad_bucket", f"{item.name} appears twice in one bucket")
        seen.add(item.name)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors)
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise EngineError("bad_bucket", f"{name} and {other} overlap in the slot")
    start, end = spans[0][0], spans[-1][1]
    payload = sum(t.nbytes for t in tensors)
    if end - start <= payload + _DENSE_SLACK_BYTES * len(tensors):
        offsets = tuple(t.offset - start for t in tensors)
        return BucketPlan(tensors, start, end, True, offsets, end - start)
    compact: list[int] = []
    at = 0
    for item in tensors:
        compact.append(at)
        at = align_up(at + item.nbytes, DEFAULT_ALIGNMENT)
    return BucketPlan(tensors, start, end, False, tuple(compact), max(at, 1))


def _device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        if device.type != "cuda":
            raise
        # Arenas released here stay allocated while the agent maps them; those it has
        # let go of are reclaimed by collecting CUDA IPC's released blocks.
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def allocate_arena(
    plan: BucketPlan, device: torch.device, shm_dir: str | None, arena_id: int
) -> Arena:
    """A new arena for `plan`: in shared memory under `shm_dir` on CPU (None: private)."""
    shared: BucketSlots | None = None
    try:
        if device.type == "cpu" and shm_dir is not None:
            shared = BucketSlots(1, plan.arena_bytes, device, shm_dir)
            buffer = shared.slots[0]
        else:
            buffer = _device_buffer(plan.arena_bytes, device)
    except (torch.OutOfMemoryError, OSError) as exc:  # a refusal, not a dead connection
        raise EngineError(
            "out_of_memory",
            f"no room on {device} to stage {plan.arena_bytes} B (the bucket of "
            f"{plan.tensors[0].name}, {len(plan.tensors)} tensors): {exc}",
        ) from exc
    views = {
        item.name: buffer[at : at + item.nbytes].view(torch_dtype(item.dtype)).view(item.shape)
        for item, at in zip(plan.tensors, plan.arena_offsets, strict=True)
    }
    return Arena(arena_id, buffer, views, shared)


def copy_bucket(
    plan: BucketPlan,
    arena: Arena,
    source: torch.Tensor,
    stream: torch.cuda.Stream | None,
    device: torch.device,
) -> None:
    """Copy one bucket from a slot into its arena (on `stream` when the slot is on the
    engine's device); return once copied: the agent may overwrite the slot then."""
    if plan.dense:
        destinations = [arena.buffer[: plan.arena_bytes]]
        sources = [source[plan.start : plan.end]]
    else:
        destinations = [
            arena.buffer[at : at + item.nbytes]
            for item, at in zip(plan.tensors, plan.arena_offsets, strict=True)
        ]
        sources = [source[item.offset : item.offset + item.nbytes] for item in plan.tensors]
    if stream is not None and source.device == device:
        with torch.cuda.stream(stream):
            copy_tensors(destinations, sources)
        stream.synchronize()
        return
    # The slot lives on another device (or the CPU): the copy moves it to ours.
    copy_tensors(destinations, sources)
    for on in {source.device, device}:
        if on.type == "cuda":
            torch.cuda.synchronize(on)


class OpenedEvents:
    """Agents' interprocess CUDA events, each recorded after a direct round's copies into
    the arenas (`commit(after=...)`): opened once per handle (an agent records the same
    event every round), a few kept."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._opened: dict[bytes, torch.cuda.Event] = {}

    def wait(self, handle: bytes) -> None:
        """Return once the event's last recorded work completed."""
        event = self._opened.get(handle)
        if event is None:
            if self.device.type != "cuda":
                raise EngineError("unsupported", "a CUDA event to wait for on a CPU engine")
            try:
                event = torch.cuda.Event.from_ipc_handle(self.device, handle)  # type: ignore[no-untyped-call]
            except RuntimeError as exc:
                raise EngineError("bad_request", f"cannot open the copies' event: {exc}") from exc
            if len(self._opened) >= 8:  # agents restarted: their old events are gone
                self._opened.clear()
            self._opened[handle] = event
        event.synchronize()
