"""What the real-engine tests share: weights, an adapter on shared-memory slots, generation.

Weights are weightsync's reference model (`servers.MODEL`) with seeded values; its greedy
decoding is the reference the engines' outputs are compared with, token for token.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import urllib.request
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tests.engines_real.servers import MODEL
from tests.support.engine_contract import pack, plan_buckets
from tests.support.eventually import eventually
from weightsync.engines._rounds import RoundAdapter
from weightsync.reference.model import LlamaForCausalLM, build_model, greedy_generate
from weightsync.transfer.buffers import BucketSlots

T = TypeVar("T")

SLOT_BYTES = 1 << 19  # 512 KiB: the 1.6 MB model goes in several buckets
BUCKET_BYTES = SLOT_BYTES // 2  # a bucket fills half a slot: room for alignment
PROMPT = [5, 6, 7, 8, 9]
NEW_TOKENS = 8


def trainer(seed: int) -> LlamaForCausalLM:
    return build_model(MODEL, seed=seed)


def state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {name: param.detach() for name, param in model.named_parameters()}


def reference_tokens(model: LlamaForCausalLM, prompt: list[int], count: int) -> list[int]:
    return greedy_generate(model, [prompt], count)[0]


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def post_json(url: str, body: Any, timeout: float = 60.0) -> Any:
    request = urllib.request.Request(  # noqa: S310 - a loopback URL the test made
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310
        return json.loads(reply.read())


def get_json(url: str, timeout: float = 60.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - a loopback URL
        return json.loads(reply.read())


def post_empty(url: str, timeout: float = 60.0) -> str:
    request = urllib.request.Request(url, method="POST")  # noqa: S310 - a loopback URL
    with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310
        text: str = reply.read().decode()
        return text


@dataclass
class Rig:
    """An adapter attached to two /dev/shm bucket slots, as a sink agent's are, driven on
    one event loop (its HTTP session belongs to that loop)."""

    adapter: RoundAdapter
    slots: BucketSlots
    loop: asyncio.AbstractEventLoop

    @classmethod
    def attach(cls, adapter: RoundAdapter) -> Rig:
        slots = BucketSlots(2, SLOT_BYTES, torch.device("cpu"), "/dev/shm")
        rig = cls(adapter, slots, asyncio.new_event_loop())
        rig.run(adapter.attach_buffers(slots.slots))
        return rig

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    async def load(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        for index, bucket in enumerate(buckets):
            slot = index % 2
            await self.adapter.load_bucket(slot, pack(self.slots.slots[slot], bucket))

    async def sync(self, weights: dict[str, torch.Tensor], version: int) -> None:
        await self.adapter.begin_update(version)
        await self.load(plan_buckets(weights, BUCKET_BYTES))
        await self.adapter.finish_update(version)

    def close(self) -> None:
        try:
            self.run(self.adapter.close())
        finally:
            self.loop.close()
            self.slots.close()


@dataclass
class Streamed:
    """A streaming generation running on a thread: the chunks as they arrive."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def wait_tokens(self, count: int, timeout: float = 30.0) -> None:
        def arrived() -> bool:
            if self.error is not None:
                raise self.error
            return len(self.chunks) >= count

        eventually(
            arrived,
            timeout=timeout,
            interval=0.01,
            message=f"{count} streamed chunks",
        )

    def join(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the streamed request did not end"
        if self.error is not None:
            raise self.error
        return self.chunks


def stream(url: str, body: dict[str, Any]) -> Streamed:
    """POST `body` (with "stream": true) and collect its server-sent events on a thread."""
    out = Streamed()

    def read() -> None:
        try:
            for event in _events(url, body):
                out.chunks.append(event)
        except BaseException as exc:  # handed to the test by `join`
            out.error = exc

    out.thread = threading.Thread(target=read, name="stream", daemon=True)
    out.thread.start()
    return out


def _events(url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    request = urllib.request.Request(  # noqa: S310 - a loopback URL the test made
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:  # noqa: S310
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
