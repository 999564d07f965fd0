"""The engine contract against real SGLang 0.5.23 and vLLM 0.32.0 CPU servers, and what
every real engine must do besides: serve what a whole agent stack publishes, and answer
every recorded exchange as the recording says (the fakes' contract with reality).

Bucket bytes reach the engines over /dev/shm: vLLM through weightsync's "weightsync_shm"
weight-transfer backend (a vLLM plugin), SGLang through its own tensor payloads.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.engines_real.agents import publish_versions
from tests.engines_real.replay_real import replay
from tests.engines_real.rig import SLOT_BYTES, get_json, state, trainer
from tests.engines_real.servers import EngineServer
from tests.engines_real.serving import ASSERT_SERVES, Weights, assert_generates
from tests.support.engine_contract import EngineContract, EngineUnderTest
from weightsync.api.v1alpha1 import Engine
from weightsync.engines.vllm import SHM_BACKEND, VLLMAdapter
from weightsync.transfer.buffers import BucketSlots

T = TypeVar("T")

pytestmark = pytest.mark.parametrize("engine_server", ["sglang", "vllm"], indirect=True)

ENGINES = {"sglang": Engine.SGLANG, "vllm": Engine.VLLM}


class RealEngine(EngineUnderTest):
    """A real engine server and an adapter on /dev/shm slots, on one event loop."""

    stages = False  # both load in place
    sequence_reason = "sequence"

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.engine = ENGINES[server.name]
        self.holds_torn = server.name == "vllm"
        self.url = server.url
        self.loop = asyncio.new_event_loop()
        self.buffers: list[BucketSlots] = []
        self.attach()
        if isinstance(self.adapter, VLLMAdapter):
            assert self.adapter.backend == SHM_BACKEND

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def new_slots(self) -> list[torch.Tensor]:
        buffers = BucketSlots(2, SLOT_BYTES, torch.device("cpu"), "/dev/shm")
        self.buffers.append(buffers)
        return list(buffers.slots)

    def weights(self, seed: int) -> Weights:
        return state(trainer(seed))

    def assert_serves(self, weights: Weights, version: int) -> None:
        ASSERT_SERVES[self.server.name](self.url, weights, version)

    def assert_at_rest(self) -> None:
        assert_generates(self.server.name, self.url)

    def assert_holds_requests(self) -> None:
        assert get_json(f"{self.url}/is_paused") == {"is_paused": True}

    def kill(self) -> None:
        os.killpg(self.server.process.pid, signal.SIGKILL)

    def close(self) -> None:
        try:
            self.run(self.adapter.close())
        finally:
            self.loop.close()
            for buffers in self.buffers:
                buffers.close()


@pytest.fixture
def engine(engine_server: EngineServer) -> Iterator[RealEngine]:
    under_test = RealEngine(engine_server)
    yield under_test
    under_test.close()


def test_agents_publish_three_versions(engine_server: EngineServer, tmp_path: Path) -> None:
    publish_versions(
        tmp_path,
        ENGINES[engine_server.name].value,
        engine_server.url,
        [1, 2, 3],
        lambda model, version: ASSERT_SERVES[engine_server.name](
            engine_server.url, state(model), version
        ),
    )


def test_every_recorded_exchange_matches_the_real_server(engine_server: EngineServer) -> None:
    # The fakes answer as the recording says (tests/unit/engines/test_recordings.py); so
    # must the real server, or a fake would be testing the adapter against a fiction.
    assert replay(engine_server.url, engine_server.name) == []


class TestEngineContract(EngineContract):
    pass
