"""What an agent vouches its engine serves, for engines that name no incarnation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Self

import torch

from weightsync.agent.engine_watch import EngineWatch
from weightsync.api.engines import EngineOptions
from weightsync.engines.base import EngineAdapter, EngineHealth
from weightsync.transfer.layout import TensorSlice


class Says(EngineAdapter):
    """Answers `health()` with what the test sets; a round never runs here. SGLang's and
    vLLM's adapters name no incarnation either (`engines.base`)."""

    def __init__(self) -> None:
        self.reply = EngineHealth(True, None)

    @classmethod
    def for_engine(cls, base_url: str, options: EngineOptions | None = None) -> Self:
        raise AssertionError("built by the test, never from a URL")

    async def attach_buffers(self, slots: Sequence[torch.Tensor], copies: int = 1) -> None:
        raise AssertionError("no round here")

    async def begin_update(self, version: int) -> None:
        raise AssertionError("no round here")

    async def load_bucket(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        raise AssertionError("no round here")

    async def finish_update(self, version: int) -> None:
        raise AssertionError("no round here")

    async def abort_update(self, version: int, reason: str) -> None:
        raise AssertionError("no round here")

    async def health(self) -> EngineHealth:
        return self.reply


def test_an_engine_restarted_at_its_start_up_label_is_not_vouched_for() -> None:
    """A vLLM server restarted in place answered `weight_version: "default"` (no
    version) with dummy weights; its agent still vouched for version 2, and the
    operator opened its gate."""
    adapter = Says()
    watch = EngineWatch(adapter)
    watch.committed("lineage-a", 2)
    adapter.reply = EngineHealth(True, 2)
    asyncio.run(watch.poll())
    assert watch.vouched() is not None
    assert watch.status().version == 2

    adapter.reply = EngineHealth(True, None)  # restarted: its start-up label
    asyncio.run(watch.poll())
    assert watch.vouched() is None
    status = watch.status()
    assert status.version is None
    assert status.detail == "restarted: behind until a round or a recovery loads it"

    adapter.reply = EngineHealth(True, 7)  # another version it was never given by us
    asyncio.run(watch.poll())
    assert watch.vouched() is None

    watch.committed("lineage-a", 3)  # a recovery loaded the current version
    assert watch.status().version == 3  # at once: the commit read it back
    adapter.reply = EngineHealth(True, 3)
    asyncio.run(watch.poll())
    assert watch.status().version == 3


def test_the_status_says_when_the_vouched_version_was_loaded() -> None:
    """The operator compares it with the engine container's start: a second restart in
    place between two of the agent's polls leaves it vouching for a process that is gone
    (`controller.readiness.loaded_before_start`)."""
    adapter = Says()
    watch = EngineWatch(adapter)
    before = time.time()
    watch.committed("lineage-a", 4)
    adapter.reply = EngineHealth(True, 4)
    asyncio.run(watch.poll())
    loaded = watch.status().loaded_unix
    assert loaded is not None
    assert before <= loaded <= time.time()
    adapter.reply = EngineHealth(True, None)  # restarted: nothing vouched, no load time
    asyncio.run(watch.poll())
    assert watch.status().loaded_unix is None
