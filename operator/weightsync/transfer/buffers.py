"""Bucket slots shared once across processes; afterwards only metadata moves.

An agent owns `pipeline_depth` slots, each one bucket's capacity of raw bytes:
* on CPU, POSIX shared memory: a file in /dev/shm mapped with `torch.from_file(shared=True)`;
* on GPU, CUDA memory from the caching allocator, exported once as a CUDA IPC handle.

`SlotHandles` is the typed, JSON-serialisable message that lets another process (the
trainer's Publisher, the engine, or an engine on the same GPU in Colocated mode) open the
same slots with `open_slots`. A CUDA handle names its GPU by UUID, so a process that sees
the GPU under another index (a different CUDA_VISIBLE_DEVICES) still finds it.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from weightsync.transfer import shm_files
from weightsync.transfer.layout import TensorSlice


class SlotError(RuntimeError):
    """A slot cannot be created, described or opened."""


class ShmSlotHandle(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: Literal["shm"] = "shm"
    path: str
    nbytes: int


class CudaIpcSlotHandle(BaseModel):
    """The fields of `UntypedStorage._share_cuda_()`, bytes as base64, device as UUID."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["cuda_ipc"] = "cuda_ipc"
    device_uuid: str
    storage_handle: str
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str
    event_sync_required: bool
    nbytes: int


SlotHandle = Annotated[ShmSlotHandle | CudaIpcSlotHandle, Field(discriminator="kind")]


class SlotHandles(BaseModel):
    """How to open an agent's bucket slots; sent once per attach.

    `copies` > 1: the slots are that many equal groups, a copy of every slot on each of
    an engine's devices (`EngineAdapter.attach_buffers`); slot i is the i-th of each.
    """

    model_config = ConfigDict(frozen=True)

    slots: list[SlotHandle]
    copies: int = Field(default=1, ge=1)

    def copy_groups(self) -> list[list[ShmSlotHandle | CudaIpcSlotHandle]]:
        """The slots of each copy, in order."""
        if len(self.slots) % self.copies:
            raise SlotError(f"{len(self.slots)} slots do not make {self.copies} equal copies")
        size = len(self.slots) // self.copies
        return [self.slots[i * size : (i + 1) * size] for i in range(self.copies)]

    def copy_for(self, device: torch.device, position: int) -> SlotHandles:
        """The copy a reader on `device` opens: the one on its own GPU, or on CPU the one
        at `position` (a worker's index). A single copy serves every reader."""
        groups = self.copy_groups()
        if len(groups) == 1:
            return SlotHandles(slots=groups[0])
        if device.type == "cuda":
            own = _device_uuid(device.index or 0)
            for group in groups:
                if all(isinstance(h, CudaIpcSlotHandle) and h.device_uuid == own for h in group):
                    return SlotHandles(slots=group)
            raise SlotError(f"none of the {self.copies} copies of the slots is on {device}")
        if not 0 <= position < len(groups):
            raise SlotError(f"no copy {position} among {self.copies} copies of the slots")
        return SlotHandles(slots=groups[position])


_shm_registry: dict[int, ShmSlotHandle] = {}
_registry_lock = threading.Lock()


def _b64(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_cuda_index(device_uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == device_uuid:
            return index
    raise SlotError(f"GPU {device_uuid} is not visible to this process")


def describe_slots(slots: Sequence[torch.Tensor]) -> SlotHandles:
    """The handle message for slots made by `BucketSlots` (or opened by `open_slots`)."""
    handles: list[ShmSlotHandle | CudaIpcSlotHandle] = []
    for slot in slots:
        if slot.dtype != torch.uint8 or slot.dim() != 1 or not slot.is_contiguous():
            raise SlotError("a slot is a contiguous 1-D uint8 tensor")
        if slot.is_cuda:
            handles.append(_describe_cuda(slot))
            continue
        with _registry_lock:
            handle = _shm_registry.get(slot.untyped_storage().data_ptr())
        if handle is None:
            raise SlotError("CPU slot is not backed by weightsync shared memory")
        handles.append(handle)
    return SlotHandles(slots=handles)


def _describe_cuda(slot: torch.Tensor) -> CudaIpcSlotHandle:
    return _describe_storage(slot.untyped_storage(), slot.numel())


def _describe_storage(storage: torch.UntypedStorage, nbytes: int) -> CudaIpcSlotHandle:
    (
        device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()  # type: ignore[no-untyped-call]
    return CudaIpcSlotHandle(
        device_uuid=_device_uuid(int(device)),
        storage_handle=_b64(storage_handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=_b64(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=_b64(event_handle),
        event_sync_required=bool(event_sync_required),
        nbytes=nbytes,
    )


def open_slots(handles: SlotHandles) -> list[torch.Tensor]:
    """Map another process's slots into this one. Keep the tensors as long as they are used."""
    return [_open_one(handle) for handle in handles.slots]


def _open_one(handle: ShmSlotHandle | CudaIpcSlotHandle) -> torch.Tensor:
    if isinstance(handle, ShmSlotHandle):
        if not Path(handle.path).exists():
            raise SlotError(f"shared memory slot {handle.path} does not exist")
        tensor = torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)
        with _registry_lock:
            _shm_registry[tensor.untyped_storage().data_ptr()] = handle
        return tensor
    index = _local_cuda_index(handle.device_uuid)
    torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        _unb64(handle.storage_handle),
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        _unb64(handle.ref_counter_handle),
        handle.ref_counter_offset,
        _unb64(handle.event_handle),
        handle.event_sync_required,
    )
    tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    tensor.set_(storage, 0, (handle.nbytes,), (1,))
    return tensor


class TensorSources(BaseModel):
    """A Publisher's own tensors, shared once by CUDA IPC so the agent packs buckets itself.

    One handle per distinct storage (a model's parameters often share few allocations);
    per tensor, in the order of the `Attach` message: its storage's index and its byte
    offset in that storage; index -1 for a tensor without bytes (CUDA IPC cannot name an
    empty storage).
    """

    model_config = ConfigDict(frozen=True)

    storages: list[CudaIpcSlotHandle]
    tensors: list[tuple[int, int]]


def describe_sources(tensors: Sequence[torch.Tensor]) -> TensorSources | None:
    """`tensors` as `TensorSources`, or None where they cannot be shared that way (on
    CPU, non-contiguous, or spread over several GPUs): then the Publisher packs."""
    if not tensors or len({t.device for t in tensors}) != 1:
        return None
    if any(not t.is_cuda or not t.is_contiguous() for t in tensors):
        return None
    index: dict[int, int] = {}
    storages: list[CudaIpcSlotHandle] = []
    entries: list[tuple[int, int]] = []
    for tensor in tensors:
        if tensor.nbytes == 0:
            entries.append((-1, 0))
            continue
        storage = tensor.untyped_storage()
        known = index.setdefault(storage.data_ptr(), len(storages))
        if known == len(storages):
            storages.append(_describe_storage(storage, storage.nbytes()))
        entries.append((known, int(tensor.storage_offset()) * tensor.element_size()))
    return TensorSources(storages=storages, tensors=entries)


def open_sources(
    sources: TensorSources, tensors: Sequence[tuple[str, tuple[int, ...], str]]
) -> list[torch.Tensor]:
    """Map another process's tensors (name, shape, dtype name, in `Attach` order)."""
    if len(sources.tensors) != len(tensors):
        raise SlotError(f"{len(sources.tensors)} shared tensors for {len(tensors)} names")
    opened = [_open_one(handle) for handle in sources.storages]
    views = []
    for (name, shape, dtype), (storage, offset) in zip(tensors, sources.tensors, strict=True):
        typed = torch_dtype(dtype)
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * typed.itemsize
        if storage == -1 and nbytes == 0:
            device = opened[0].device if opened else torch.device("cuda")
            views.append(torch.empty(shape, dtype=typed, device=device))
            continue
        if not 0 <= storage < len(opened):
            raise SlotError(f"tensor {name!r}: no shared storage {storage}")
        base = opened[storage]
        if offset < 0 or offset + nbytes > base.numel():
            raise SlotError(f"tensor {name!r} lies outside its shared storage")
        views.append(base[offset : offset + nbytes].view(typed).view(shape))
    return views


class BucketSlots:
    """`depth` slots of `capacity` bytes on `device`, owned by this process."""

    def __init__(self, depth: int, capacity: int, device: torch.device, shm_dir: str) -> None:
        if depth < 1:
            raise SlotError(f"pipeline depth must be at least 1, got {depth}")
        self.capacity = capacity
        self.device = device
        self._files: list[tuple[Path, int]] = []  # CPU slots' files and their locks
        self.slots: list[torch.Tensor] = []
        try:
            for index in range(depth):
                self.slots.append(self._allocate(index, shm_dir))
        except BaseException:
            self.close()
            raise
        self.handles = describe_slots(self.slots)

    def _allocate(self, index: int, shm_dir: str) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        if self.device.type != "cpu":
            raise SlotError(f"unsupported slot device {self.device}")
        path, fd = shm_files.create(shm_dir, index)
        self._files.append((path, fd))  # locked while we keep it (`shm_files`)
        try:
            # Reserve the pages now: a tmpfs that runs out while a slot is written kills
            # this process with SIGBUS; here it is an error that says what is missing.
            os.posix_fallocate(fd, 0, self.capacity)
        except OSError as exc:
            free = os.statvfs(shm_dir)
            raise SlotError(
                f"{shm_dir} has {free.f_bavail * free.f_frsize} bytes free; a bucket slot "
                f"needs {self.capacity} ({exc.strerror}): mount a larger memory-backed "
                f"volume at {shm_dir}, or lower transfer.bucketSizeBytes"
            ) from exc
        tensor = torch.from_file(str(path), shared=True, size=self.capacity, dtype=torch.uint8)
        with _registry_lock:
            _shm_registry[tensor.untyped_storage().data_ptr()] = ShmSlotHandle(
                path=str(path), nbytes=self.capacity
            )
        return tensor

    def close(self) -> None:
        """Unlink the shared memory names; processes that mapped them keep their mapping."""
        with _registry_lock:
            for slot in self.slots:
                _shm_registry.pop(slot.untyped_storage().data_ptr(), None)
        for path, fd in self._files:
            shm_files.release(path, fd)
        self._files.clear()


_DTYPES: dict[str, torch.dtype] = {}


def torch_dtype(name: str) -> torch.dtype:
    """`torch.<name>` for a dtype name as the layout writes it."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        candidate = getattr(torch, name, None)
        if not isinstance(candidate, torch.dtype):
            raise SlotError(f"unknown dtype {name!r}")
        dtype = _DTYPES[name] = candidate
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def slot_views(slot: torch.Tensor, tensors: Sequence[TensorSlice]) -> list[torch.Tensor]:
    """Typed, shaped views of `tensors` inside `slot`; compute once per slot and bucket."""
    return [
        slot[t.offset : t.offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape)
        for t in tensors
    ]


# From this size on a tensor is copied on its own: a plain copy of a contiguous tensor is a
# memcpy at full memory bandwidth, while the multi-tensor kernel works through large
# tensors in small chunks and is slower for them. Smaller tensors share one multi-tensor
# launch, which is what makes state dicts of thousands of small tensors cheap to pack.
LARGE_COPY_BYTES = 4 << 20


def copy_tensors(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy `sources` into `destinations`: large tensors one copy each, the rest batched."""
    small_destinations: list[torch.Tensor] = []
    small_sources: list[torch.Tensor] = []
    for destination, source in zip(destinations, sources, strict=True):
        if destination.nbytes >= LARGE_COPY_BYTES:
            destination.copy_(source)
        else:
            small_destinations.append(destination)
            small_sources.append(source)
    if small_destinations:
        torch._foreach_copy_(small_destinations, small_sources)
