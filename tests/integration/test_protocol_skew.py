"""Protocol skew with real processes: agents (a source, and a sink feeding a reference
engine) planned by an operator one protocol version newer, then by this release's
operator client, run rounds that reach the engine bit for bit."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import torch

from tests.integration.contract import ContractConfig, expect_served, make_plan, start
from tests.integration.stack import AgentProc, free_port, stack, wait_warm
from weightsync.api.control import AgentStatus, Backend
from weightsync.api.protocol import HEADER, PROTOCOL_VERSION
from weightsync.client import Publisher
from weightsync.controller.agents.client import AgentAddress, AgentClient
from weightsync.reference.model import PRESETS, build_model, randomize

CONFIG = ContractConfig(backend=Backend.GLOO, devices=["cpu", "cpu"], bucket_delay_seconds=0)


def put_as_newer_operator(agent: AgentProc, body: str) -> int:
    """`PUT /v1/plan` as an operator of the next protocol version sends it; the status."""
    request = urllib.request.Request(  # noqa: S310 - our own URL
        f"{agent.url}/v1/plan", method="PUT", data=body.encode()
    )
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {agent.token}")
    request.add_header(HEADER, str(PROTOCOL_VERSION + 1))
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - our own URL
        return int(response.status)


async def plan_as_this_operator(agents: list[AgentProc], generation: int, port: int) -> None:
    """Learn each agent's version from its status, then deliver a generation's plans."""
    client = AgentClient(timeout_seconds=10)
    addresses = [AgentAddress(a.proc.name, "127.0.0.1", a.http_port) for a in agents]
    try:
        answers, errors = await client.statuses(addresses, agents[0].token)
        assert errors == {}
        assert {s.protocol_version for s in answers.values()} == {PROTOCOL_VERSION}
        pods = [a.proc.name for a in agents]
        plans = {
            address.pod: (address, make_plan(CONFIG, generation, rank, pods, port))
            for rank, address in enumerate(addresses)
        }
        versions = {pod: status.protocol_version for pod, status in answers.items()}
        assert await client.deliver(plans, agents[0].token, versions) == {}
    finally:
        await client.close()


def test_agents_work_on_under_a_newer_operator_and_this_one(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with stack(tmp_path) as st:
        source, sinks = start(CONFIG, tmp_path, st)
        agents = [source, *sinks]
        engines = [s.engine for s in sinks if s.engine is not None]
        pods = [a.proc.name for a in agents]
        port = free_port()
        for rank, agent in enumerate(agents):
            plan = json.loads(make_plan(CONFIG, 1, rank, pods, port).model_dump_json())
            plan["placement"] = {"zone": "a"}  # what the next version might add
            plan["transfer"]["compression"] = "zstd"
            assert put_as_newer_operator(agent, json.dumps(plan)) == 202
        wait_warm(agents, 1, timeout=40.0)
        # The operator of the previous release sends no version and reads none back.
        assert AgentStatus.model_validate(source.status().model_dump()).protocol_version == 1

        trainer = build_model(PRESETS[CONFIG.preset], seed=0, device="cpu")
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            randomize(trainer, seed=1001)
            first = publisher.publish(trainer.named_parameters(), version=1)
            assert first.ok, first
            expect_served(trainer, engines, 1)

            asyncio.run(plan_as_this_operator(agents, 2, port))
            wait_warm(agents, 2, timeout=40.0)
            randomize(trainer, seed=1002)
            second = publisher.publish(trainer.named_parameters(), version=2)
            assert second.ok, second
            assert second.generation == 2
            expect_served(trainer, engines, 2)
        logged = (tmp_path / "sink-1.log").read_text()
        assert logged.count("ignoring fields") == 1, logged
        assert "MembershipPlan.placement" in logged
