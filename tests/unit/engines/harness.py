"""One harness per engine so a behaviour both adapters share is tested once for both."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tests.unit.engines.fakes.common import serve
from tests.unit.engines.fakes.sglang_server import FakeSGLang
from tests.unit.engines.fakes.vllm_server import FakeVLLM
from tests.unit.engines.support import buckets, cpu_slots, pack
from weightsync.engines._rounds import RoundAdapter
from weightsync.engines.sglang import SGLangAdapter, SGLangSettings
from weightsync.engines.vllm import VLLMAdapter, VLLMSettings
from weightsync.transfer.layout import TensorSlice

Fake = FakeSGLang | FakeVLLM

SLOT_BYTES = 4096


@dataclass(frozen=True)
class EngineCase:
    name: str
    make_fake: Callable[..., Fake]
    make_adapter: Callable[..., RoundAdapter]
    load_path: str
    begin_paths: tuple[str, ...]
    finish_paths: tuple[str, ...]
    resume_path: str
    label_path: str

    def __str__(self) -> str:
        return self.name


SGLANG = EngineCase(
    name="sglang",
    make_fake=lambda model, **kw: FakeSGLang(model=model, **kw),
    make_adapter=lambda url, **kw: SGLangAdapter(SGLangSettings(base_url=url, **kw)),
    load_path="/update_weights_from_tensor",
    begin_paths=(
        "/model_info",
        "/pause_generation",
        "/begin_weight_update",
        "/update_weight_version",
    ),
    finish_paths=(
        "/end_weight_update",
        "/flush_cache",
        "/update_weight_version",
        "/continue_generation",
        "/model_info",
    ),
    resume_path="/continue_generation",
    label_path="/model_info",
)

VLLM = EngineCase(
    name="vllm",
    make_fake=lambda model, **kw: FakeVLLM(model=model, **kw),
    make_adapter=lambda url, **kw: VLLMAdapter(VLLMSettings(base_url=url, **kw)),
    load_path="/update_weights",
    begin_paths=(
        "/weight_info",
        "/pause",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weight_version",
    ),
    finish_paths=("/finish_weight_update", "/resume", "/weight_info"),
    resume_path="/resume",
    label_path="/weight_info",
)

CASES = (SGLANG, VLLM)


@dataclass
class Link:
    """An adapter attached to two CPU slots and the URL of the engine it talks to."""

    adapter: RoundAdapter
    slots: list[torch.Tensor]
    url: str

    async def load_model(
        self, model: dict[str, torch.Tensor], *, align: int = 64, limit: int | None = None
    ) -> int:
        """Pack the model bucket by bucket into alternating slots and load each bucket, as
        an agent's double buffer would; return the number of buckets."""
        plan = buckets(model, SLOT_BYTES // 2)[:limit]  # half a slot leaves room for padding
        for index, bucket in enumerate(plan):
            slices: list[TensorSlice] = pack(self.slots[index % 2], bucket, align=align)
            await self.adapter.load_bucket(index % 2, slices)
        return len(plan)

    async def sync(self, model: dict[str, torch.Tensor], version: int) -> None:
        """A whole round."""
        await self.adapter.begin_update(version)
        await self.load_model(model)
        await self.adapter.finish_update(version)


@asynccontextmanager
async def connected(case: EngineCase, fake: Fake, **settings: Any) -> AsyncIterator[Link]:
    """The fake served on a loopback port and an adapter attached to two CPU slots."""
    async with serve(fake.app()) as url:
        adapter = case.make_adapter(url, **settings)
        slots = cpu_slots(2, SLOT_BYTES)
        await adapter.attach_buffers(slots)
        try:
            yield Link(adapter, slots, url)
        finally:
            await adapter.close()
