"""Name the bytes of an agent's bucket slot to an engine in another process.

Both SGLang and vLLM receive tensors as pickled torch rebuild calls: the same
`(rebuild function, args)` pairs that torch's own `ForkingPickler` reductions produce.
This module builds those pairs for byte ranges of the agent's slots, without importing
either engine.

* CUDA slots are exported once, at attach, with torch's `reduce_tensor`. Every bucket
  then reuses that export, changing only the view's size and offset in the args. A new
  export per bucket would wrap the slot's storage in one more CUDA IPC ref-counted
  context each time (torch keeps the chain until the storage dies), so a long-lived slot
  must be exported once; vLLM's own packed IPC producer does the same. The device is
  named by GPU UUID (args[6]): SGLang's patched `rebuild_cuda_tensor` maps a UUID to the
  receiver's own index, and vLLM overwrites args[6] with its worker's device.
* CPU slots (CI) cannot be named as they are: the engines' unpicklers only open torch's
  own shared-memory storages (`rebuild_storage_filename`), which carry a ref-count header
  the agent's raw shared-memory files do not have. So each CPU slot gets a staging copy
  in torch's file-system shared memory, and a bucket's bytes are copied there before the
  engine is asked to read them. GPUs never take this path.

A slot handed to an engine is read by the engine's CUDA stream, which does not wait for
the agent's writes: the agent calls `load_bucket` only after the bucket's bytes are
complete in the slot (its receive has been synchronized), as vLLM's producer does.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing import reductions

from weightsync.api.reasons import EngineErrorReason
from weightsync.engines.base import EngineError
from weightsync.transfer.layout import TensorSlice

CPU_DEVICE_KEY = "cpu"

# `reduce_tensor`'s args for a CUDA tensor, by position (torch.multiprocessing.reductions).
_ARG_SIZE = 1
_ARG_STRIDE = 2
_ARG_OFFSET = 3
_ARG_DEVICE = 6


def device_key(device: torch.device, copy: int | None = None) -> str:
    """How engines name a device in IPC handles: the GPU's UUID, or "cpu". CPU copies of
    one slot (an engine of several workers on CPU) are told apart by their position:
    copy i is "cpu:i"."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    if device.type == "cpu":
        return CPU_DEVICE_KEY if copy is None else f"{CPU_DEVICE_KEY}:{copy}"
    raise ValueError(f"slots on {device.type} devices cannot be shared with an engine")


class _UntypedShmStorage:
    """Pickles as torch's own file-system shared-memory storage handle."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._storage = storage
        manager, handle, size = storage._share_filename_cpu_()
        self._args = (type(storage), manager, handle, size)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # Every reader's rebuild drops one reference; take it here, as torch's reducer does.
        self._storage._shared_incref()  # type: ignore[no-untyped-call]
        return reductions.rebuild_storage_filename, self._args


class _TypedShmStorage:
    def __init__(self, untyped: _UntypedShmStorage) -> None:
        self._untyped = untyped

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return reductions.rebuild_typed_storage, (self._untyped, torch.uint8)


class SlotView:
    """Bytes [start, start + length) of an exported slot; pickles as a uint8 tensor."""

    def __init__(self, slot: ExportedSlot, start: int, length: int) -> None:
        self.slot = slot
        self.start = start
        self.length = length

    def rebuild_args(self) -> tuple[Any, ...]:
        """The args of the rebuild call (for CUDA: `rebuild_cuda_tensor`'s fifteen)."""
        return self.slot.view_args(self.start, self.length)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return self.slot.rebuild_function, self.rebuild_args()


class ExportedSlot:
    """One copy of one agent slot, exported once for an engine in another process."""

    def __init__(self, tensor: torch.Tensor, copy: int | None = None) -> None:
        if not tensor.is_contiguous():
            raise ValueError("a bucket slot must be contiguous")
        self.tensor = tensor.detach().reshape(-1).view(torch.uint8)
        self.nbytes = self.tensor.numel()
        self.device = self.tensor.device
        self.key = device_key(self.device, copy)
        self.order = (0 if self.device.type == "cpu" else 1, self.device.index or 0, copy or 0)
        self._base_offset = self.tensor.storage_offset()
        self._staging: torch.Tensor | None = None
        if self.device.type == "cuda":
            self.rebuild_function: Callable[..., Any] = reductions.rebuild_cuda_tensor
            _, args = reductions.reduce_tensor(self.tensor)  # type: ignore[no-untyped-call]
            exported = list(args)
            exported[_ARG_DEVICE] = self.key
            self._cuda_args = tuple(exported)
        else:
            self.rebuild_function = reductions.rebuild_tensor
            self._staging = torch.empty(self.nbytes, dtype=torch.uint8)
            self._typed = _TypedShmStorage(_UntypedShmStorage(self._staging.untyped_storage()))

    def view_args(self, start: int, length: int) -> tuple[Any, ...]:
        if self._staging is None:
            args = list(self._cuda_args)
            args[_ARG_SIZE] = torch.Size([length])
            args[_ARG_STRIDE] = (1,)
            args[_ARG_OFFSET] = self._base_offset + start
            return tuple(args)
        metadata = (start, torch.Size([length]), (1,), False)
        return (torch.Tensor, self._typed, metadata)

    def stage(self, start: int, length: int) -> None:
        """Make bytes [start, start + length) readable by the engine (a copy on CPU only)."""
        if self._staging is not None:
            self._staging[start : start + length].copy_(self.tensor[start : start + length])

    def view(self, start: int, length: int) -> SlotView:
        return SlotView(self, start, length)


@dataclass(frozen=True, slots=True)
class LogicalSlot:
    """One slot index of the contract: its copies, one per device, in device order."""

    copies: tuple[ExportedSlot, ...]

    @property
    def nbytes(self) -> int:
        return self.copies[0].nbytes


def export_slots(slots: Sequence[torch.Tensor], copies: int = 1) -> list[LogicalSlot]:
    """Export the agent's slots. Logical slot i is the i-th slot on every device.

    An engine with one GPU gets one slot per index. An agent that holds a copy of each
    bucket on several devices (one per tensor-parallel worker) passes its slots grouped
    by device, in the same order on every device, and `copies` the number of groups; the
    contract's `slot` index then names all copies. GPU groups are keyed by their GPU,
    CPU groups by their position (`device_key`).
    """
    if not slots:
        raise ValueError("attach_buffers needs at least one slot")
    if copies < 1 or len(slots) % copies:
        raise ValueError(f"{len(slots)} slots do not make {copies} equal copies")
    per_copy = len(slots) // copies
    by_device: dict[str, list[ExportedSlot]] = {}
    for position, tensor in enumerate(slots):
        exported = ExportedSlot(tensor, position // per_copy if copies > 1 else None)
        by_device.setdefault(exported.key, []).append(exported)
    if copies > 1 and len(by_device) != copies:
        raise ValueError(f"{copies} copies of the slots lie on {len(by_device)} devices")
    ordered = sorted(by_device.values(), key=lambda group: group[0].order)
    counts = {len(group) for group in ordered}
    if len(counts) != 1:
        raise ValueError(
            f"every device must hold the same number of slots, got {[len(g) for g in ordered]}"
        )
    sizes = [[copy.nbytes for copy in group] for group in ordered]
    if any(row != sizes[0] for row in sizes):
        raise ValueError(f"slot sizes differ between devices: {sizes}")
    return [LogicalSlot(copies=tuple(group[i] for group in ordered)) for i in range(counts.pop())]


_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise EngineError(EngineErrorReason.BAD_BUCKET, f"unknown dtype {name!r}") from None


def check_slices(tensors: Sequence[TensorSlice], slot_nbytes: int) -> tuple[int, int]:
    """Validate a bucket's tensors against its slot; return the byte span [lo, hi) they use."""
    if not tensors:
        raise EngineError(EngineErrorReason.BAD_BUCKET, "a bucket holds at least one tensor")
    lo, hi = slot_nbytes, 0
    for item in tensors:
        dtype = torch_dtype(item.dtype)
        numel = 1
        for dim in item.shape:
            numel *= dim
        if item.nbytes != numel * dtype.itemsize:
            raise EngineError(
                EngineErrorReason.BAD_BUCKET,
                f"{item.name}: nbytes {item.nbytes} != {item.shape} x {dtype.itemsize} bytes",
            )
        if item.offset < 0 or item.offset + item.nbytes > slot_nbytes:
            raise EngineError(
                EngineErrorReason.BAD_BUCKET,
                f"{item.name}: bytes [{item.offset}, {item.offset + item.nbytes}) "
                f"lie outside the {slot_nbytes}-byte slot",
            )
        if item.offset % dtype.itemsize:
            raise EngineError(
                EngineErrorReason.BAD_BUCKET,
                f"{item.name}: offset {item.offset} is not a multiple of {dtype.itemsize}",
            )
        lo = min(lo, item.offset)
        hi = max(hi, item.offset + item.nbytes)
    return lo, hi


def metadata_record(item: TensorSlice, start: int) -> types.SimpleNamespace:
    """One tensor's entry in a flattened bucket, as SGLang's loader reads it (by attribute)."""
    return types.SimpleNamespace(
        name=item.name,
        shape=torch.Size(item.shape),
        dtype=torch_dtype(item.dtype),
        start_idx=start,
        end_idx=start + item.nbytes,
        numel=item.nbytes,
    )
