"""The reference engine's weight store: staged, all-or-nothing updates from bucket slots.

Updates never touch the served weights until `commit`: each bucket is copied from the
agent's shared slot into a staging copy of the tensor, and `commit` swaps every staged
tensor in under the model lock, so a generate request sees either the old version or
the new one, and an aborted round leaves the old one untouched. The buffers freed by a
commit become the next round's staging buffers: two copies of the weights, no
allocation per round.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from collections.abc import Sequence

import torch

from weightsync.engines.base import EngineError, EngineHealth, TensorSlice
from weightsync.engines.reference.model import LlamaForCausalLM, greedy_generate
from weightsync.transfer.buffers import (
    SlotHandles,
    copy_tensors,
    dtype_name,
    open_slots,
    slot_views,
)


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (moved to CPU first); equal digests mean equal bits."""
    data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8)
    raw = (ctypes.c_char * data.numel()).from_address(data.data_ptr())
    return hashlib.sha256(raw).hexdigest()


class ReferenceEngine:
    def __init__(self, model: LlamaForCausalLM, version: int | None = None) -> None:
        self.model = model
        self.version = version
        self.params = dict(model.named_parameters())
        self._lock = threading.Lock()  # generate vs commit
        self._slots: list[torch.Tensor] = []
        self._spare: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}
        self._staging_version: int | None = None

    # --------------------------------------------------------------- serving
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], int | None]:
        vocab = self.model.config.vocab_size
        if any(not 0 <= token < vocab for prompt in prompts for token in prompt):
            raise EngineError("bad_request", f"token ids must be in [0, {vocab})")
        if any(not prompt for prompt in prompts):
            raise EngineError("bad_request", "empty prompt")
        with self._lock:
            return greedy_generate(self.model, prompts, max_new_tokens), self.version

    def health(self) -> EngineHealth:
        detail = "updating" if self._staging_version is not None else ""
        return EngineHealth(healthy=True, version=self.version, detail=detail)

    def digests(self) -> tuple[int | None, dict[str, str]]:
        with self._lock:
            return self.version, {name: tensor_digest(p) for name, p in self.params.items()}

    # --------------------------------------------------------------- updates
    def attach(self, handles: SlotHandles) -> None:
        self._slots = open_slots(handles)

    def begin(self, version: int) -> None:
        if self.version is not None and version <= self.version:
            raise EngineError("stale_version", f"version {version} <= served {self.version}")
        self._staged.clear()
        self._staging_version = version

    def load(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        if self._staging_version is None:
            raise EngineError("no_update", "load before begin")
        if not 0 <= slot < len(self._slots):
            raise EngineError("bad_slot", f"slot {slot} not attached ({len(self._slots)} slots)")
        destinations: list[torch.Tensor] = []
        for item in tensors:
            param = self.params.get(item.name)
            if param is None:
                raise EngineError("unknown_tensor", f"no parameter named {item.name!r}")
            if tuple(param.shape) != item.shape or dtype_name(param.dtype) != item.dtype:
                raise EngineError(
                    "tensor_mismatch",
                    f"{item.name}: got {item.dtype}{list(item.shape)}, "
                    f"serving {dtype_name(param.dtype)}{list(param.shape)}",
                )
            spare = self._spare.get(item.name)
            if spare is None:
                spare = self._spare[item.name] = torch.empty_like(param)
            destinations.append(spare)
        # The slot lives on the agent's device; the copy moves it to ours if they differ.
        source = self._slots[slot]
        copy_tensors(destinations, slot_views(source, tensors))
        if source.is_cuda:  # the agent may overwrite the slot as soon as we return
            torch.cuda.current_stream(source.device).synchronize()
        for item, dest in zip(tensors, destinations, strict=True):
            self._staged[item.name] = dest

    def commit(self, version: int) -> None:
        if self._staging_version != version:
            raise EngineError("no_update", f"commit of {version} without begin")
        missing = self.params.keys() - self._staged.keys()
        if missing:
            raise EngineError(
                "incomplete_update", f"{len(missing)} tensors not loaded, e.g. {min(missing)}"
            )
        with self._lock:
            for name, staged in self._staged.items():
                param = self.params[name]
                self._spare[name] = param.data
                param.data = staged
            self.version = version
        self._staged.clear()
        self._staging_version = None

    def abort(self, version: int) -> None:
        """Drop what was staged; the served weights were never touched."""
        if self._staging_version == version:
            self._staged.clear()
            self._staging_version = None
