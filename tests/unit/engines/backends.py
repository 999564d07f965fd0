"""The engines the unit tier runs the engine contract against, all in this process.

The reference engine is the real one (its HTTP app and update channel, served here). SGLang
and vLLM cannot run here: their recorded fakes stand in (`fakes/`, held to the recordings
by `test_recordings.py`, the recordings held to the real servers by `engines_real`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from aiohttp.test_utils import TestServer

from tests.support.engine_contract import EngineUnderTest, Weights
from tests.unit.engines.fakes.common import serve
from tests.unit.engines.fakes.sglang_server import FakeSGLang
from tests.unit.engines.fakes.vllm_server import FakeVLLM
from tests.unit.engines.support import cpu_slots, make_model, zeros_like_model
from weightsync.api.reasons import EngineErrorReason
from weightsync.api.v1alpha1 import Engine
from weightsync.engines.base import EngineError
from weightsync.reference.channel import UpdateChannelServer
from weightsync.reference.engine import ReferenceEngine
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import PRESETS, build_model
from weightsync.reference.server import make_app
from weightsync.transfer.buffers import BucketSlots

T = TypeVar("T")

REFERENCE_MODEL = PRESETS["tiny"]  # 21 tensors, the largest 64 KiB
FAKE_SLOT_BYTES = 4096
KV_CACHE_BYTES = 1 << 20


class InProcess(EngineUnderTest):
    """An engine served on this test's event loop."""

    def __init__(self, tmp_path: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.stack = AsyncExitStack()
        self.tmp_path = tmp_path
        self.buffers: list[BucketSlots] = []

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def slots_of(self, nbytes: int) -> list[torch.Tensor]:
        buffers = BucketSlots(2, nbytes, torch.device("cpu"), str(self.tmp_path))
        self.buffers.append(buffers)
        return list(buffers.slots)

    def close(self) -> None:
        try:
            self.run(self.adapter.close())
            self.run(self.stack.aclose())
        finally:
            self.loop.close()
            for buffers in self.buffers:
                buffers.close()


class Reference(InProcess):
    """The reference engine: its HTTP app and its update channel (arenas in shared memory,
    filled by the adapter, as on a node)."""

    engine = Engine.REFERENCE
    stages = True
    sequence_reason = "no_update"
    releases_memory = True

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        arenas = tmp_path / "arenas"
        arenas.mkdir()
        self.served = ReferenceEngine(
            build_model(REFERENCE_MODEL, seed=0), shm_dir=str(arenas), kv_cache_bytes=KV_CACHE_BYTES
        )
        self.stack.callback(self.served.close)
        address = f"@weightsync-test-{uuid.uuid4().hex}"
        self.channel = UpdateChannelServer(self.served, address)
        self.channel.start()
        self.stack.callback(self.channel.close)
        self.http = TestServer(make_app(self.served, update_channel=address))
        self.run(self.stack.enter_async_context(self.http))
        self.url = str(self.http.make_url("")).rstrip("/")
        self.attach()

    def new_slots(self) -> list[torch.Tensor]:
        return self.slots_of(256 << 10)

    def weights(self, seed: int) -> Weights:
        model = build_model(REFERENCE_MODEL, seed=seed)
        return {name: param.detach() for name, param in model.named_parameters()}

    def assert_serves(self, weights: Weights, version: int) -> None:
        want = {name: tensor_digest(tensor) for name, tensor in weights.items()}
        assert self.served.digests() == (version, want)

    def assert_at_rest(self) -> None:
        assert self.served.health().detail != "updating"
        tokens, _ = self.served.generate([[1, 2, 3]], 1)
        assert len(tokens[0]) == 1

    def resident_bytes(self) -> int:
        return self.served.resident_bytes

    def assert_refuses_inference(self) -> None:
        with pytest.raises(EngineError) as caught:
            self.served.generate([[1, 2, 3]], 1)
        assert caught.value.reason == EngineErrorReason.SLEEPING

    def kill(self) -> None:
        self.channel.close()
        self.run(self.http.close())


class RecordedFake(InProcess):
    """SGLang's or vLLM's recorded fake on a loopback port."""

    sequence_reason = "sequence"

    def __init__(self, tmp_path: Path, fake: FakeSGLang | FakeVLLM) -> None:
        super().__init__(tmp_path)
        self.fake = fake
        self.url = self.run(self.stack.enter_async_context(serve(fake.app())))
        self.attach()

    def new_slots(self) -> list[torch.Tensor]:
        # Plain CPU tensors: handed over as torch's own shared-memory handles (the fakes
        # speak the GPU `ipc` backend; shared-memory files are the real CPU servers').
        return cpu_slots(2, FAKE_SLOT_BYTES)

    def weights(self, seed: int) -> Weights:
        return make_model(seed)

    def assert_serves(self, weights: Weights, version: int) -> None:
        assert self.fake.model.keys() == weights.keys()
        for name, tensor in weights.items():
            assert self.fake.model[name].dtype == tensor.dtype, name
            assert torch.equal(self.fake.model[name], tensor), name
        assert self.fake.weight_version == str(version)

    def assert_at_rest(self) -> None:
        assert not self.fake.paused
        assert not self.fake.in_session
        assert self.fake.healthy

    def assert_holds_requests(self) -> None:
        assert self.fake.paused
        assert not self.fake.in_session
        assert self.fake.healthy

    def kill(self) -> None:
        self.fake.controls.crashed = True


class SGLangFake(RecordedFake):
    engine = Engine.SGLANG
    stages = False

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, FakeSGLang(model=zeros_like_model(make_model())))


class VLLMFake(RecordedFake):
    engine = Engine.VLLM
    stages = False
    holds_torn = True

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, FakeVLLM(model=zeros_like_model(make_model())))


BACKENDS: dict[str, type[InProcess]] = {
    "reference": Reference,
    "sglang-fake": SGLangFake,
    "vllm-fake": VLLMFake,
}
