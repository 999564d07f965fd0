"""The operator's agent client: an answer counts only from the pod asked."""

from __future__ import annotations

import asyncio

from aiohttp import web

from tests.unit.controller.builders import agent, agent_server
from weightsync.api.control import STATUS_ADDITIONS, AgentStatus
from weightsync.controller.agents.client import AgentAddress, AgentClient
from weightsync.controller.agents.view import silent


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


def test_the_operator_asks_for_the_fields_it_reads_and_an_older_agent_still_parses() -> None:
    """Fields added to `AgentStatus` are sent only when asked for: this operator asks for
    the transport; an agent that predates it ignores the query and answers without it."""
    asked: list[str] = []

    async def scenario() -> None:
        async def status(request: web.Request) -> web.Response:
            asked.extend(request.query.getall("with", []))
            body = agent("e-1").model_dump_json(exclude={"recovery_transport"})
            return web.Response(text=body, content_type="application/json")

        app = web.Application()
        app.router.add_get("/v1/status", status)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        agents = AgentClient(timeout_seconds=10)
        try:
            answer = await agents.status(
                AgentAddress("e-1", "127.0.0.1", runner.addresses[0][1]), "token"
            )
            assert isinstance(answer, AgentStatus)
            assert answer.recovery_transport is None
        finally:
            await agents.close()
            await runner.cleanup()

    asyncio.run(scenario())
    assert asked == [",".join(STATUS_ADDITIONS)]
    assert "recovery_transport" in STATUS_ADDITIONS
