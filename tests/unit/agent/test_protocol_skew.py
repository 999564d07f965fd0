"""The skew policy across the wire: the real agent control API (in-process, on a real
socket) against the operator's real `AgentClient`, and against requests as operators
of other protocol versions send them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.integration.stack import free_port
from weightsync.agent.control_api import make_control_app
from weightsync.agent.service import Agent
from weightsync.agent.settings import AgentSettings
from weightsync.api import protocol
from weightsync.api.control import AgentStatus, MembershipPlan
from weightsync.api.protocol import HEADER, PROTOCOL_VERSION
from weightsync.controller.agents.client import AgentAddress, AgentClient

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POD = "trainer-0"
N = PROTOCOL_VERSION

Body = Callable[[Agent, TestClient, AgentAddress, list[dict[str, Any]]], Awaitable[None]]


def plan(generation: int, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "sync_name": "ns/sync",
        "generation": generation,
        "rank": 0,
        "backend": "gloo",
        "rendezvous": {"host": "127.0.0.1", "port": port},
        "members": [{"rank": 0, "pod": POD, "host": "127.0.0.1", "role": "source"}],
        **extra,
    }


def with_agent(tmp_path: Path, body: Body) -> None:
    """Run `body` against a source agent's control API; the plans it received (as JSON)
    are recorded in the list `body` gets."""
    settings = AgentSettings(
        role="source", token=TOKEN, pod_name=POD, socket=tmp_path / "a.sock", shm_dir=tmp_path
    )
    received: list[dict[str, Any]] = []

    @web.middleware
    async def record(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.method == "PUT":
            received.append(json.loads(await request.read()))
        return await handler(request)

    async def run() -> None:
        agent = Agent(settings)
        app = make_control_app(agent)
        app.middlewares.append(record)
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        address = AgentAddress(POD, "127.0.0.1", client.server.port or 0)
        try:
            await body(agent, client, address, received)
        finally:
            await client.close()
            await agent.close()

    asyncio.run(run())


def test_the_operator_learns_the_agent_s_version_and_plans_it(tmp_path: Path) -> None:
    async def body(
        agent: Agent, _: TestClient, address: AgentAddress, received: list[dict[str, Any]]
    ) -> None:
        operator = AgentClient(timeout_seconds=5)
        try:
            status = await operator.status(address, TOKEN)
            assert isinstance(status, AgentStatus), status
            assert status.protocol_version == N
            generation = MembershipPlan.model_validate(plan(1, free_port()))
            versions = {POD: status.protocol_version}
            delivered = await operator.deliver({POD: (address, generation)}, TOKEN, versions)
            assert delivered == {}
        finally:
            await operator.close()
        assert received[0]["holder"] is False  # nothing left out between equals
        assert agent.generations.get(1) is not None

    with_agent(tmp_path, body)


def test_an_operator_of_the_previous_release_never_sees_the_version(tmp_path: Path) -> None:
    """It sends no version and forbids unknown fields: the field would break every poll."""

    async def body(agent: Agent, client: TestClient, *_: Any) -> None:
        plain = await (await client.get("/v1/status", headers=AUTH)).json()
        assert "protocol_version" not in plain
        said = await client.get("/v1/status", headers={**AUTH, HEADER: str(N)})
        assert (await said.json())["protocol_version"] == N
        bad = await client.get("/v1/status", headers={**AUTH, HEADER: "latest"})
        assert bad.status == 400
        assert (await bad.json())["error"] == "invalid_request"

    with_agent(tmp_path, body)


def test_a_newer_operator_s_fields_are_ignored_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    newer = {**AUTH, HEADER: str(N + 1)}

    async def body(agent: Agent, client: TestClient, *_: Any) -> None:
        extra = plan(1, port, affinity="numa", transfer={"checksum": True, "codec": "zstd"})
        with caplog.at_level(logging.INFO, logger="weightsync.agent.control_api"):
            first = await client.put("/v1/plan", json=extra, headers=newer)
            assert first.status == 202, await first.text()
            again = await client.put("/v1/plan", json=extra, headers=newer)
            assert again.status == 202
        ignoring = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
        assert len(ignoring) == 1, ignoring
        assert "MembershipPlan.affinity" in ignoring[0]
        assert "MembershipPlan.transfer.codec" in ignoring[0]
        held = agent.generations.get(1)
        assert held is not None
        assert held.plan.transfer.checksum  # the fields it knows are kept

    with_agent(tmp_path, body)


@pytest.mark.parametrize("sender", [None, str(N)])
def test_an_unknown_field_from_an_operator_not_newer_is_a_400_naming_it(
    tmp_path: Path, sender: str | None
) -> None:
    headers = AUTH if sender is None else {**AUTH, HEADER: sender}

    async def body(agent: Agent, client: TestClient, *_: Any) -> None:
        typo = plan(1, free_port(), transfer={"chekcsum": True})
        response = await client.put("/v1/plan", json=typo, headers=headers)
        assert response.status == 400
        refused = await response.json()
        assert refused["error"] == "invalid_plan"
        assert "transfer.chekcsum" in refused["detail"]
        assert agent.generations.all() == []

    with_agent(tmp_path, body)


def test_an_agent_of_the_previous_version_gets_no_field_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if `holder` came in this version: the agent of the one before lacks it.
    monkeypatch.setattr(protocol, "ADDED", {**protocol.ADDED, "MembershipPlan.holder": N})

    async def body(
        agent: Agent, _: TestClient, address: AgentAddress, received: list[dict[str, Any]]
    ) -> None:
        operator = AgentClient(timeout_seconds=5)
        port = free_port()
        try:
            quiet = MembershipPlan.model_validate(plan(1, port))
            assert await operator.put_plan(address, quiet, TOKEN, peer_version=N - 1) is None
            assert "holder" not in received[-1]
            assert agent.generations.get(1) is not None
            # One that asks it to hold is not sent: the older agent could not.
            holding = MembershipPlan.model_validate(plan(2, port, holder=True))
            refused = await operator.put_plan(address, holding, TOKEN, peer_version=N - 1)
            assert refused is not None
            assert "holder" in refused
            assert f"protocol version {N - 1}" in refused
            assert len(received) == 1
            assert await operator.put_plan(address, holding, TOKEN, peer_version=N) is None
            assert received[-1]["holder"] is True
        finally:
            await operator.close()

    with_agent(tmp_path, body)
