"""The source timer asks the trainer's agents alone, every second, and runs a pass only
when one's answer changed, sweeping every agent first when it is a round: a published
version shows within a second or two, not at the drift timer's next sweep (agents'
HTTP, served here)."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.unit.controller.builders import agent, agent_server, sink_view, source_view
from tests.unit.controller.builders import reconciler as make_reconciler
from weightsync.api.control import AgentStatus, GenerationState
from weightsync.api.v1alpha1 import Role
from weightsync.controller.agents.client import AgentClient
from weightsync.controller.passes.memory import Memory

KEY = ("ns", "sync")


def test_a_pass_follows_a_change_in_the_trainers_answer_and_only_then() -> None:
    async def scenario() -> None:
        said: dict[str, Any] = {"version": 1, "generations": {}}

        def answer() -> AgentStatus:
            return agent(
                "trainer-0", Role.SOURCE, version=said["version"], generations=said["generations"]
            )

        trainer, trainer_port = await agent_server("trainer-0", 0.0, answer)
        engine, engine_port = await agent_server("e-0", 0.0)
        agents = AgentClient(timeout_seconds=2)
        reconciler = make_reconciler(agents)
        passes: list[tuple[str, str]] = []

        async def run(namespace: str, name: str) -> None:
            passes.append((namespace, name))

        reconciler.run = run  # type: ignore[assignment,method-assign]
        pods = [
            source_view("trainer-0", ip="127.0.0.1", agent_port=trainer_port),
            sink_view("e-0", ip="127.0.0.1", agent_port=engine_port),
        ]
        memory = reconciler._memory[KEY] = Memory()
        try:
            await reconciler.watch_sources(*KEY)  # no pass has named the agents yet
            assert passes == []
            seen = await reconciler.observer.answers(KEY, pods, "token", memory)  # a pass's
            assert set(seen.statuses) == {"trainer-0", "e-0"}
            assert memory.sources == {"trainer-0"}
            engine_heard = memory.agents.heard_at["e-0"]

            await reconciler.watch_sources(*KEY)
            assert passes == []  # the same answer: nothing new
            assert memory.agents.heard_at["e-0"] == engine_heard  # engines are not asked

            said["version"] = 2  # a round: the engines are swept before the pass
            await reconciler.watch_sources(*KEY)
            assert passes == [KEY]
            assert memory.agents.statuses["trainer-0"].version == 2
            swept = memory.agents.heard_at["e-0"]
            assert swept > engine_heard
            await reconciler.watch_sources(*KEY)
            assert passes == [KEY]

            said["generations"] = {2: (GenerationState.WARM, 0)}  # no round: no sweep
            await reconciler.watch_sources(*KEY)
            assert passes == [KEY, KEY]
            assert memory.agents.heard_at["e-0"] == swept

            await trainer.cleanup()  # the trainer's agent stops answering: news too
            await reconciler.watch_sources(*KEY)
            assert passes == [KEY, KEY, KEY]
            assert "trainer-0" in memory.agents.errors
        finally:
            await agents.close()
            await trainer.cleanup()
            await engine.cleanup()

    asyncio.run(scenario())
