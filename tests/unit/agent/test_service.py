"""The agent's control API in-process: auth, plan validation, background pre-warm, status."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.integration.stack import free_port
from weightsync.agent.control_api import make_control_app, make_metrics_app
from weightsync.agent.recovery import RecoveryFailed
from weightsync.agent.service import Agent
from weightsync.agent.settings import AgentSettings
from weightsync.api.control import AgentStatus, GenerationState, MembershipPlan, RecoverRequest
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.transfer.p2p_protocol import Resolution

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def plan(generation: int, port: int, *, rank: int = 0, sinks: int = 0) -> str:
    members = [{"rank": 0, "pod": "trainer-0", "host": "127.0.0.1", "role": "source"}]
    members += [
        {"rank": i, "pod": f"infer-{i}", "host": "127.0.0.1", "role": "sink"}
        for i in range(1, sinks + 1)
    ]
    return MembershipPlan.model_validate(
        {
            "sync_name": "unit",
            "generation": generation,
            "rank": rank,
            "backend": "gloo",
            "rendezvous": {"host": "127.0.0.1", "port": port},
            "members": members,
        }
    ).model_dump_json()


ON_TCP = Resolution(RecoveryProtocol.TCP, True, "Auto: TCP, since no RDMA device")


def with_agent(
    tmp_path: Path,
    body: Callable[[Agent, TestClient], Awaitable[None]],
    transport: Resolution | None = None,
) -> None:
    settings = AgentSettings(
        role="source", token=TOKEN, socket=tmp_path / "agent.sock", shm_dir=tmp_path
    )

    async def run() -> None:
        agent = Agent(settings, transport)
        client = TestClient(TestServer(make_control_app(agent)))
        await client.start_server()
        try:
            await body(agent, client)
        finally:
            await client.close()
            await agent.close()

    asyncio.run(run())


def test_every_route_needs_the_token(tmp_path: Path) -> None:
    async def body(agent: Agent, client: TestClient) -> None:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            response = await client.get("/v1/status", headers=headers)
            assert response.status == 401
            assert (await response.json())["error"] == "unauthorized"
            response = await client.put("/v1/plan", data=plan(1, 1), headers=headers)
            assert response.status == 401
        assert agent.generations.all() == []

    with_agent(tmp_path, body)


def test_plans_are_validated_and_formed_in_the_background(tmp_path: Path) -> None:
    port = free_port()

    async def body(agent: Agent, client: TestClient) -> None:
        response = await client.put("/v1/plan", data="{}", headers=AUTH)
        assert response.status == 400
        response = await client.put("/v1/plan", data=plan(1, port, rank=1, sinks=1), headers=AUTH)
        assert response.status == 409, "a sink's rank sent to a source agent"

        response = await client.put("/v1/plan", data=plan(2, port), headers=AUTH)
        assert response.status == 202
        assert json.loads(await response.text()) == {"generation": 2, "rank": 0, "world_size": 1}
        again = await client.put("/v1/plan", data=plan(2, port), headers=AUTH)
        assert again.status == 202, "the same plan twice is idempotent"
        stale = await client.put("/v1/plan", data=plan(1, port), headers=AUTH)
        assert stale.status == 409

        generation = agent.generations.get(2)
        assert generation is not None
        await asyncio.wait_for(generation.formed.wait(), 30)
        status = AgentStatus.model_validate_json(
            await (await client.get("/v1/status", headers=AUTH)).text()
        )
        assert status.warm
        assert status.generation == 2
        assert status.version is None
        assert [g.state for g in status.generations] == [GenerationState.WARM]
        assert status.generations[0].prewarm_millis is not None

        metrics = TestClient(TestServer(make_metrics_app(agent)))
        await metrics.start_server()
        try:
            text = await (await metrics.get("/metrics")).text()
        finally:
            await metrics.close()
        assert 'weightsync_prewarm_duration_seconds_count{role="source"} 1.0' in text
        assert 'weightsync_current_version{role="source"} -1.0' in text

    with_agent(tmp_path, body)


def test_the_transport_is_reported_only_to_an_operator_that_asks(tmp_path: Path) -> None:
    """An operator older than the field forbids unknown fields: it must never see it."""

    async def body(agent: Agent, client: TestClient) -> None:
        plain = await (await client.get("/v1/status", headers=AUTH)).json()
        assert "recovery_transport" not in plain
        assert AgentStatus.model_validate(plain).recovery_transport is None
        asked = await client.get("/v1/status?with=recovery_transport", headers=AUTH)
        status = AgentStatus.model_validate_json(await asked.text())
        assert status.recovery_transport is not None
        assert status.recovery_transport.model_dump() == {
            "protocol": RecoveryProtocol.TCP,
            "usable": True,
            "detail": "Auto: TCP, since no RDMA device",
        }
        assert agent.holder.enabled  # a source holds by default

    with_agent(tmp_path, body, ON_TCP)


def test_an_agent_whose_protocol_cannot_work_neither_holds_nor_pulls(tmp_path: Path) -> None:
    broken = Resolution(RecoveryProtocol.RDMA, False, "RDMA requested, but no RDMA device")

    async def body(agent: Agent, client: TestClient) -> None:
        assert not agent.holder.enabled
        status = AgentStatus.model_validate_json(
            await (await client.get("/v1/status?with=recovery_transport", headers=AUTH)).text()
        )
        assert status.recovery_transport is not None
        assert not status.recovery_transport.usable

    with_agent(tmp_path, body, broken)


@pytest.mark.parametrize(
    ("transport", "asked", "refused"),
    [
        (ON_TCP, RecoveryProtocol.RDMA, True),  # RDMA holders are out of a TCP agent's reach
        (ON_TCP, RecoveryProtocol.TCP, False),
        (Resolution(RecoveryProtocol.RDMA, True, "Auto: RDMA"), RecoveryProtocol.TCP, False),
        (Resolution(RecoveryProtocol.RDMA, False, "no device"), RecoveryProtocol.RDMA, True),
    ],
)
def test_a_sink_refuses_a_pull_over_a_protocol_it_cannot_use(
    tmp_path: Path, transport: Resolution, asked: RecoveryProtocol, refused: bool
) -> None:
    settings = AgentSettings(role="sink", engine="Reference", token=TOKEN, shm_dir=tmp_path)
    request = RecoverRequest(version=1, holders=["http://h:1"], protocol=asked)

    async def run() -> None:
        agent = Agent(settings, transport)
        try:
            if refused:
                with pytest.raises(RecoveryFailed, match="cannot pull over"):
                    agent.start_recovery(request)
            else:
                assert agent.start_recovery(request).version == 1  # started
        finally:
            await agent.close()

    asyncio.run(run())


def test_the_engine_readiness_probe_needs_no_token_and_says_why(tmp_path: Path) -> None:
    """The kubelet sends no token: the one open route answers only ready or not, and why."""

    async def body(agent: Agent, client: TestClient) -> None:
        response = await client.get("/v1/engine/ready")
        assert response.status == 503  # a source watches no engine
        assert await response.text() == "this agent watches no engine\n"
        assert (await client.get("/v1/status")).status == 401

    with_agent(tmp_path, body)
