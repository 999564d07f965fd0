"""A pass asks new agents for their first answer, but waits for them only so long: one
slow agent must not hold up the pass for the others (agents' HTTP, served here)."""

from __future__ import annotations

import asyncio

from tests.unit.controller.builders import agent_server, sink_view
from tests.unit.controller.builders import reconciler as make_reconciler
from weightsync.controller.agents.client import AgentClient
from weightsync.controller.passes import observe
from weightsync.controller.passes.memory import Memory

SLOW_SECONDS = observe.NEWCOMER_WAIT_SECONDS + 1.5


def test_a_slow_newcomer_is_recorded_later_and_brings_its_own_pass() -> None:
    async def scenario() -> None:
        fast, fast_port = await agent_server("e-fast", 0.0)
        slow, slow_port = await agent_server("e-slow", SLOW_SECONDS)
        agents = AgentClient(timeout_seconds=10)
        reconciler = make_reconciler(agents)
        requested: list[tuple[str, str]] = []
        reconciler.request = lambda namespace, name: requested.append((namespace, name))  # type: ignore[method-assign]
        pods = [
            sink_view("e-fast", ip="127.0.0.1", agent_port=fast_port),
            sink_view("e-slow", ip="127.0.0.1", agent_port=slow_port, index=1),
        ]
        memory = Memory()
        try:
            seen = await reconciler.observer.answers(("ns", "sync"), pods, "token", memory)
            assert set(seen.statuses) == {"e-fast"}  # the pass went on without e-slow
            assert memory.asking == {"e-slow"}
            assert requested == []
            # A second pass meanwhile does not ask e-slow again.
            await reconciler.observer.answers(("ns", "sync"), pods, "token", memory)
            assert len(memory.asks) == 1
            await asyncio.gather(*memory.asks)
            assert set(memory.agents.statuses) == {"e-fast", "e-slow"}
            assert memory.asking == set()
            assert requested == [("ns", "sync")]  # its answer brings a pass
        finally:
            await agents.close()
            await fast.cleanup()
            await slow.cleanup()

    asyncio.run(scenario())
