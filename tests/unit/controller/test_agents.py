"""The operator's agent client: an answer counts only from the pod asked."""

from __future__ import annotations

import asyncio

from tests.unit.controller.builders import agent_server
from weightsync.controller.agents import AgentAddress, AgentClient
from weightsync.controller.agentview import silent


def test_an_answer_for_another_pod_is_no_answer() -> None:
    """An address passed on to a new pod: whoever answers there is not this pod's agent."""

    async def scenario() -> None:
        server, port = await agent_server("e-old", 0.0)
        agents = AgentClient(timeout_seconds=10)
        try:
            answers, errors = await agents.statuses(
                [
                    AgentAddress("e-new", "127.0.0.1", port),
                    AgentAddress("e-old", "127.0.0.1", port),
                ],
                "token",
            )
            assert set(answers) == {"e-old"}
            assert errors["e-new"].endswith("the agent of pod e-old")
            assert not silent(errors["e-new"])  # an answer: evidence, not a timeout
        finally:
            await agents.close()
            await server.cleanup()

    asyncio.run(scenario())
