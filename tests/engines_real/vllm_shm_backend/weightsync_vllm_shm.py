"""A vLLM weight-transfer backend that reads buckets from weightsync's shared-memory slots.

On GPU weightsync drives vLLM's own "ipc" backend: each `/update_weights` names a run of
tensors in the agent's bucket slot by a CUDA IPC handle. CUDA IPC does not exist on CPU,
so CPU machines (CI) register this backend, "weightsync_shm", through vLLM's plugin
mechanism (the `vllm.general_plugins` entry point, loaded in every vLLM process). It
keeps every other part of the protocol as the ipc backend has it: the same routes, the
same session (`start_weight_update` / `finish_weight_update` run vLLM's layerwise reload,
as the ipc backend's do), the same packed layout (`names`, `dtype_names`, `shapes`,
`tensor_sizes`: tensors back to back from the first byte). Only the handle differs: the
agent's slot is a file in /dev/shm, named by `shm_path`, and the run starts at
`shm_offset` bytes into it.

The bytes are copied out of the slot before the call returns, as vLLM's packed IPC
consumer copies them out of the CUDA buffer, so the agent may reuse the slot once the
reply arrives.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

if TYPE_CHECKING:
    from collections.abc import Iterator

BACKEND = "weightsync_shm"
# Only files here are read: the route is reachable by whoever reaches the engine's port.
SHM_DIR = Path("/dev/shm")


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it once in each of its processes."""
    # A ValueError says it is registered already in this process.
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, "SharedMemoryWeightTransferEngine"
        )


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """The ipc backend's init info; the slots need no rendezvous. Only packed runs exist."""

    packed: bool = True

    def __post_init__(self) -> None:
        if not self.packed:
            raise ValueError(f"{BACKEND} reads packed runs only: send init_info packed=true")


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One packed run: the ipc backend's fields, with a shared-memory file for a handle."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    tensor_sizes: list[int]
    shm_path: str
    shm_offset: int = 0
    dtypes: list[torch.dtype] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        count = len(self.names)
        if not len(self.dtype_names) == len(self.shapes) == len(self.tensor_sizes) == count:
            raise ValueError(
                "names, dtype_names, shapes and tensor_sizes must have one entry per tensor"
            )
        path = Path(self.shm_path)
        if path.parent != SHM_DIR or not path.name.startswith("weightsync-"):
            raise ValueError(f"shm_path must name a weightsync slot in {SHM_DIR}: {path}")
        if self.shm_offset < 0:
            raise ValueError(f"shm_offset must be >= 0, got {self.shm_offset}")
        self.dtypes = []
        for name, dtype_name, shape, size in zip(
            self.names, self.dtype_names, self.shapes, self.tensor_sizes, strict=True
        ):
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name}: unknown dtype {dtype_name!r}")  # noqa: TRY004 - vLLM turns ValueError into a 400
            numel = 1
            for dim in shape:
                numel *= dim
            if numel * dtype.itemsize != size:
                raise ValueError(f"{name}: {size} bytes cannot hold {shape} x {dtype_name}")
            self.dtypes.append(dtype)


class SharedMemoryWeightTransferEngine(
    WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]
):
    """Loads packed runs read from weightsync's /dev/shm bucket slots."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        """Nothing to set up: every update names its slot file."""

    def start_weight_update(self) -> None:
        # The same layerwise reload the ipc backend starts: what a checkpoint load does.
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        self.model.load_weights(_read_run(update_info))

    def shutdown(self) -> None:
        """Nothing is held between updates."""


def _read_run(info: SharedMemoryUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
    total = sum(info.tensor_sizes)
    packed = torch.empty(total, dtype=torch.uint8)
    with open(info.shm_path, "rb", buffering=0) as slot:
        size = os.fstat(slot.fileno()).st_size
        if info.shm_offset + total > size:
            raise ValueError(
                f"bytes [{info.shm_offset}, {info.shm_offset + total}) lie outside "
                f"{info.shm_path} ({size} bytes)"
            )
        slot.seek(info.shm_offset)
        view = memoryview(packed.numpy())
        read = 0
        while read < total:
            got = slot.readinto(view[read:])
            if not got:
                raise ValueError(f"{info.shm_path} ended after {info.shm_offset + read} bytes")
            read += got
    for name, dtype, shape, piece in zip(
        info.names, info.dtypes, info.shapes, packed.split(info.tensor_sizes), strict=True
    ):
        yield name, piece.view(dtype).reshape(shape)
