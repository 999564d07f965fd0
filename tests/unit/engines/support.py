"""Models, buckets and slots for the engine adapter tests."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from weightsync.transfer.layout import TensorSlice

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def make_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small Llama-shaped parameter set in mixed dtypes (what an engine holds)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return {
        "model.embed_tokens.weight": rand(32, 16),
        "model.layers.0.self_attn.qkv_proj.weight": rand(48, 16),
        "model.layers.0.self_attn.o_proj.weight": rand(16, 16),
        "model.layers.0.mlp.gate_up_proj.weight": rand(64, 16),
        "model.layers.0.input_layernorm.weight": rand(16, dtype=torch.float32),
        "model.norm.weight": rand(16, dtype=torch.float32),
        "lm_head.weight": rand(32, 16),
    }


def zeros_like_model(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(tensor) for name, tensor in model.items()}


def pack(
    slot: torch.Tensor,
    named: list[tuple[str, torch.Tensor]],
    *,
    start: int = 0,
    align: int = 1,
) -> list[TensorSlice]:
    """Write `named` into `slot` back to back from `start` (each offset rounded up to
    `align`); return their slices, as an agent's bucket layout would."""
    slices: list[TensorSlice] = []
    offset = start
    for name, tensor in named:
        offset = -(-offset // align) * align
        raw = tensor.contiguous().view(-1).view(torch.uint8)
        slot[offset : offset + raw.numel()].copy_(raw)
        slices.append(
            TensorSlice(
                name=name,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=tuple(tensor.shape),
                offset=offset,
                nbytes=raw.numel(),
            )
        )
        offset += raw.numel()
    return slices


def buckets(model: dict[str, torch.Tensor], capacity: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split the model into buckets of at most `capacity` bytes, in name order."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, tensor in model.items():
        nbytes = tensor.numel() * tensor.element_size()
        if used + nbytes > capacity and out[-1]:
            out.append([])
            used = 0
        out[-1].append((name, tensor))
        used += nbytes
    return out


def cpu_slots(count: int, nbytes: int) -> list[torch.Tensor]:
    return [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]
