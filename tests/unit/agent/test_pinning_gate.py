"""Pinning waits while a round runs: the gate a round closes, and the buffer that waits.

`FakeCudart` stands in for the CUDA runtime (`cudaHostRegister`), which needs a GPU:
it records each slice registered. The GPU path itself runs in tests/gpu
(test_recovery_gpu.py, test_holder_fence_gpu.py) and in `bench_broadcast --holder`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import torch

from tests.support.plans import local_plan
from tests.unit.agent.test_holder import LAYOUT, endpoints, new_holder, stage_round, version_bytes
from weightsync.agent import host_memory
from weightsync.agent.generations import Generation
from weightsync.agent.host_memory import PinGate, PinnedBuffer
from weightsync.agent.round_book import RoundBook
from weightsync.agent.rounds import RoundOutcome
from weightsync.api.control import Backend, GenerationState, TransferOptions
from weightsync.transfer.p2p import Endpoints

__all__ = ["endpoints"]  # the module-scoped fixture, shared with test_holder


class FakeCudart:
    """Records registered slices; no GPU involved (named fake: the CUDA runtime)."""

    def __init__(self) -> None:
        self.registered: list[int] = []

    def cudaHostRegister(self, address: object, length: object, flags: int) -> int:  # noqa: N802
        self.registered.append(int(length.value))  # type: ignore[attr-defined]
        return 0

    def cudaHostUnregister(self, address: object) -> int:  # noqa: N802
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(host_memory, "_cudart", lambda: fake)
    monkeypatch.setattr(host_memory, "_SLICE_PAUSE_SECONDS", 0.0)
    monkeypatch.setattr(torch.cuda, "device", lambda _: contextlib.nullcontext())
    return fake


def test_pinning_waits_while_the_gate_is_closed(cudart: FakeCudart) -> None:
    gate = PinGate()
    gate.pause()
    made: list[PinnedBuffer] = []
    nbytes = 3 * host_memory._SLICE_BYTES
    worker = threading.Thread(
        target=lambda: made.append(PinnedBuffer(nbytes, torch.device("cuda", 0), gate))
    )
    worker.start()
    time.sleep(0.2)
    assert cudart.registered == [], "a slice was pinned while a round ran"
    gate.resume()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert sum(cudart.registered) == nbytes
    assert len(cudart.registered) == 3
    made[0].release()


def test_a_round_closes_the_holders_gate_until_it_ends(endpoints: Endpoints) -> None:
    holder, metrics = new_holder(endpoints)
    book = RoundBook(holder, metrics, None)
    book.started(_warm_generation())
    assert not holder.pinning._open.is_set()
    book.finished(RoundOutcome.failed(1, 1, time.monotonic(), "transfer_failed", "x"))
    assert holder.pinning._open.is_set()
    book.started(_warm_generation())
    holder.close()  # an agent shutting down mid-round lets a waiting allocation finish
    assert holder.pinning._open.is_set()


def _warm_generation() -> Generation:
    plan = local_plan(
        ["a", "b"], 1, generation=1, port=1, backend=Backend.GLOO, transfer=TransferOptions()
    )
    return Generation(plan, GenerationState.WARM)


def test_the_holders_registered_memory_is_a_metric(endpoints: Endpoints) -> None:
    holder, metrics = new_holder(endpoints)

    async def scenario() -> None:
        await stage_round(holder, LAYOUT, 1, version_bytes(LAYOUT, 1), len(LAYOUT.buckets))
        assert holder.commit(1, "L1")

    asyncio.run(scenario())
    assert metrics.holder_host_bytes._value.get() >= LAYOUT.total_bytes  # type: ignore[attr-defined]
    holder.release()
    assert metrics.holder_host_bytes._value.get() == 0  # type: ignore[attr-defined]
    holder.close()
