"""The reference engine's memory between Colocated rounds: its KV-cache reservation and
what it has released (`engine.ReferenceEngine.release` / `resume`).

The reference model decodes without a KV cache (it favours clarity), but a serving
engine reserves one up front, the largest thing it can give back while the trainer
trains; `KVCacheReserve` is that reservation, allocated for real so that releasing it
frees memory that can be measured. `storage_bytes` and `tensor_digest` say what tensors
hold: how many bytes, and which.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from weightsync.api.engines import MemoryTag
from weightsync.api.reasons import EngineErrorReason
from weightsync.engines.base import EngineError


@dataclass
class Sleep:
    """What the engine has released, and whether its weights are still missing (released,
    and no round committed new ones since: waking them brings memory, not bytes)."""

    released: frozenset[MemoryTag] = field(default_factory=frozenset)
    weights_gone: bool = False

    @property
    def detail(self) -> str:
        """How health says it ("" when awake)."""
        if self.released:
            return f"sleeping: {', '.join(sorted(self.released))} released"
        if self.weights_gone:
            return "sleeping: weights released, until a round loads new ones"
        return ""

    def check_awake(self, what: str) -> None:
        if self.released or self.weights_gone:
            raise EngineError(EngineErrorReason.SLEEPING, f"cannot {what}: {self.detail}")

    def check_weights(self, what: str) -> None:
        if self.weights_gone:
            raise EngineError(EngineErrorReason.SLEEPING, f"cannot {what}: {self.detail}")


class KVCacheReserve:
    """`nbytes` reserved on `device` (zeroed, so the pages are resident), or none."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes < 0:
            raise ValueError(f"a KV cache of {nbytes} bytes")
        self.size = nbytes
        self.device = device
        self._buffer: torch.Tensor | None = None
        self.allocate()

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def allocate(self) -> None:
        if self._buffer is None and self.size:
            self._buffer = torch.zeros(self.size, dtype=torch.uint8, device=self.device)

    def free(self) -> None:
        self._buffer = None


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views count once)."""
    sizes: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (moved to CPU first); equal digests mean equal bits."""
    data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8)
    raw = (ctypes.c_char * data.numel()).from_address(data.data_ptr())
    return hashlib.sha256(raw).hexdigest()
