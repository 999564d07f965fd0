"""What an agent vouches its engine serves, and the engine container's readiness it answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Self

import torch
from aiohttp import web

from tests.integration.stack import free_port
from weightsync.agent.engine_ready import engine_ready
from weightsync.agent.engine_watch import EngineWatch
from weightsync.api.engine_probe import EngineProbe
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


def test_the_engine_container_is_ready_on_start_up_weights_and_then_only_with_ours() -> None:
    """The kubelet asks the agent (`engine_ready`): before the first load the engine is
    ready when healthy (the gate keeps it out of traffic, and it must be ready to be
    planned); once loaded, a restarted process is not ready until loaded again."""
    adapter = Says()
    watch = EngineWatch(adapter)
    assert watch.readiness() == (False, "the engine has not answered its agent yet")
    adapter.reply = EngineHealth(False, None, detail="connection refused")
    asyncio.run(watch.poll())
    assert watch.readiness() == (False, "the engine is not healthy: connection refused")
    adapter.reply = EngineHealth(True, None)  # up, on its start-up weights
    asyncio.run(watch.poll())
    assert watch.readiness()[0]

    watch.committed("lineage-a", 2)
    adapter.reply = EngineHealth(True, 2)
    asyncio.run(watch.poll())
    assert watch.readiness()[0]
    adapter.reply = EngineHealth(True, None)  # restarted in place: start-up weights again
    asyncio.run(watch.poll())
    ready, why = watch.readiness()
    assert not ready
    assert why == "restarted: behind until a round or a recovery loads it"
    adapter.reply = EngineHealth(True, 2, torn=True)
    asyncio.run(watch.poll())
    assert watch.readiness() == (False, "an aborted update left the engine inconsistent")
    watch.committed("lineage-a", 3)  # a recovery loaded it
    assert watch.readiness()[0]
    watch.checked_at -= 11.0  # an agent that stopped polling vouches for nothing
    assert not watch.readiness()[0]


def test_an_engine_with_an_incarnation_restarted_at_the_same_version_is_not_ready() -> None:
    class Named(Says):
        @property
        def attached_to(self) -> str | None:
            return "process-1"  # the reference engine names its process

    adapter = Named()
    watch = EngineWatch(adapter)
    watch.committed("lineage-a", 5)
    adapter.reply = EngineHealth(True, 5, incarnation="process-1")
    asyncio.run(watch.poll())
    assert watch.readiness()[0]
    adapter.reply = EngineHealth(True, 5, incarnation="process-2")  # same label, new process
    asyncio.run(watch.poll())
    assert not watch.readiness()[0]


def test_the_users_own_check_is_repeated_and_counts() -> None:
    """`engine_ready` repeats the probe the webhook replaced: an engine its agent finds
    healthy but whose own check fails is not ready, and the answer says why."""

    async def run() -> None:
        answer = {"status": 200}

        async def health(_: web.Request) -> web.Response:
            return web.Response(status=answer["status"])

        app = web.Application()
        app.router.add_get("/ready", health)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            adapter = Says()
            watch = EngineWatch(adapter)
            await watch.poll()
            http = EngineProbe(kind="http", port=port, path="/ready")
            here = "127.0.0.1"  # the pod's IP, where the repeated check goes
            assert (await engine_ready(watch, http, here))[0]
            answer["status"] = 503
            assert await engine_ready(watch, http, here) == (
                False, "the engine's own readiness check failed: GET /ready answered 503"
            )  # fmt: skip
            assert (await engine_ready(watch, EngineProbe(kind="tcp", port=port), here))[0]
            named = EngineProbe(kind="tcp", port=port, host=here)  # the probe's own host
            assert (await engine_ready(watch, named, "192.0.2.1"))[0]
            await runner.cleanup()
            ready, why = await engine_ready(watch, EngineProbe(kind="tcp", port=port), here)
            assert not ready
            assert "ConnectionRefusedError" in why
            assert await engine_ready(None, None, here) == (False, "this agent watches no engine")
        finally:
            await runner.cleanup()

    asyncio.run(run())


class Slow(Says):
    """Answers `health()` only when the test lets it: a poll in flight across a commit."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def health(self) -> EngineHealth:
        await self.answer.wait()
        return self.reply


def test_a_poll_asked_before_a_commit_does_not_unvouch_it() -> None:
    """The engine's answer to a poll begun mid-round (its previous or partial label)
    arrived after the round committed and overwrote the commit: the agent stopped
    vouching for the version it had just loaded, and the operator started a recovery."""

    async def scenario() -> None:
        adapter = Slow()
        watch = EngineWatch(adapter)
        watch.committed("lineage-a", 1)
        adapter.reply = EngineHealth(True, 1)
        adapter.answer.set()
        await watch.poll()
        adapter.answer.clear()
        in_flight = asyncio.create_task(watch.poll())  # asked while version 2 loads
        await asyncio.sleep(0)
        watch.committed("lineage-a", 2)
        adapter.answer.set()  # answers with what it served when asked
        assert (await in_flight).version == 1
        assert watch.status().version == 2
        assert watch.readiness()[0]
        adapter.reply = EngineHealth(True, None)  # the next poll still sees a restart
        await watch.poll()
        assert watch.status().version is None

    asyncio.run(scenario())
