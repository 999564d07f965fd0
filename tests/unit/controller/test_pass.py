"""Whole passes, observe -> decide -> apply, between a served API server and served agents
(the workloads and the WeightSync read from a stand-in for the watches): the first pass
writes the token Secret, delivers generation 1 while the status names it, and hands the
gates over; the next pass keeps that generation and writes no token again. A token
write that fails comes after the plans."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from kubernetes import client

from tests.support.serving import start
from tests.unit.api.builders import weightsync
from tests.unit.controller.builders import agent, pod
from weightsync.api import GROUP, PLURAL, VERSION, reasons
from weightsync.api.control import AgentStatus, GenerationState, MembershipPlan, PlanAccepted
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names
from weightsync.controller.agents.client import AgentClient
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.membership.workloads import World
from weightsync.controller.passes.actions import Outcome
from weightsync.controller.passes.reconcile import Reconciler
from weightsync.controller.settings import OperatorSettings
from weightsync.controller.status.observed import EventSpec

KEY = ("ns", "sync")
SETTLED = 10.0  # how long the background gate writes may take
POD_NAMES = ("trainer-0", "e-1", "e-2")
OPEN = (
    "True",
    reasons.SERVES_CURRENT_VERSION,
)  # the sinks' gates, as an earlier operator left them


class Cluster(Kube):
    """The API server at `url` for writes; the WeightSync and its workloads as the watches
    would hold them; the token Secret recorded."""

    def __init__(self, url: str, raw: dict[str, Any], world: World) -> None:
        super().__init__(client.ApiClient(client.Configuration(host=url)))
        self.raw, self.world = raw, world
        self.tokens: list[str] = []
        self.token_error: Exception | None = None  # the next token write raises it
        self.on_token: Callable[[], None] = lambda: None  # called as a token is written

    def get_weightsync(self, namespace: str, name: str) -> dict[str, Any]:
        return self.raw

    def list_weightsyncs(self, namespace: str) -> list[dict[str, Any]]:
        return [self.raw]

    def observe(self, *_: Any, **__: Any) -> World:
        return self.world

    async def write_token(self, namespace: str, raw: Mapping[str, Any], token: str) -> None:
        error, self.token_error = self.token_error, None
        if error is not None:
            raise error
        self.on_token()
        self.tokens.append(token)


@dataclass
class Served:
    """What the API server and the agents were sent."""

    cluster: Cluster
    reconciler: Reconciler
    answers: dict[str, AgentStatus]  # what each agent says when asked
    plans: list[MembershipPlan]
    statuses: list[dict[str, Any]]  # status bodies written
    gates: dict[str, str]  # pod -> weights-current status
    gated: asyncio.Event  # both sinks' gates were written
    events: list[EventSpec]


def _world(ports: Mapping[str, int]) -> World:
    def agent_on(built: dict[str, Any], name: str) -> dict[str, Any]:
        built["metadata"]["annotations"][names.AGENT_PORT_ANNOTATION] = str(ports[name])
        return built

    trainer = pod("trainer-0").owned_by("StatefulSet", "trainer", "sts")
    sinks = [pod(n).owned_by("ReplicaSet", "engine-a-abc", "rs") for n in ("e-1", "e-2")]
    deployment = {"kind": "Deployment", "metadata": {"name": "engine-a", "uid": "dep"},
                  "spec": {"replicas": 2}}  # fmt: skip
    replicaset = {"kind": "ReplicaSet", "metadata": {"name": "engine-a-abc", "uid": "rs",
                  "ownerReferences": [{"kind": "Deployment", "name": "engine-a", "uid": "dep",
                                       "controller": True}]}}  # fmt: skip
    return World(
        trainer={"kind": "StatefulSet", "metadata": {"name": "trainer", "uid": "sts"}},
        engines={"engine-a": deployment},
        controllers=[replicaset],
        pods=[
            agent_on(trainer.running("127.0.0.1").injected().build(), "trainer-0"),
            *(
                agent_on(s.running("127.0.0.1").injected(gate=True).gate(*OPEN).build(), n)
                for s, n in zip(sinks, ("e-1", "e-2"), strict=True)
            ),
        ],
    )


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[Served]:
    runners = []
    ports = {}
    answers = {
        "trainer-0": agent("trainer-0", Role.SOURCE),
        "e-1": agent("e-1"),
        "e-2": agent("e-2"),
    }
    plans: list[MembershipPlan] = []
    for name in POD_NAMES:

        async def status(_: web.Request, name: str = name) -> web.Response:
            return web.Response(text=answers[name].model_dump_json())

        async def put_plan(request: web.Request) -> web.Response:
            plan = MembershipPlan.model_validate_json(await request.read())
            plans.append(plan)
            accepted = PlanAccepted(generation=plan.generation, rank=plan.rank, world_size=3)
            return web.Response(status=202, text=accepted.model_dump_json())

        app = web.Application()
        app.router.add_get("/v1/status", status)
        app.router.add_put("/v1/plan", put_plan)
        runner, ports[name] = await start(app)
        runners.append(runner)

    raw = weightsync("sync").namespace("ns").build()
    raw["metadata"].update(uid="u", generation=1, resourceVersion="1",
                           creationTimestamp="2026-01-01T00:00:00Z")  # fmt: skip
    written: list[dict[str, Any]] = []
    gates: dict[str, str] = {}
    gated = asyncio.Event()  # both sinks' gates were written
    world = _world(ports)

    async def patch_status(request: web.Request) -> web.Response:
        body = await request.json()
        written.append(body["status"])
        version = str(int(cluster.raw["metadata"]["resourceVersion"]) + 1)
        meta = {**cluster.raw["metadata"], "resourceVersion": version}
        cluster.raw = {**cluster.raw, "status": body["status"], "metadata": meta}
        return web.json_response(cluster.raw)

    async def patch_pod_status(request: web.Request) -> web.Response:
        body = await request.json()
        for condition in body["status"]["conditions"]:
            if condition["type"] == names.WEIGHTS_CURRENT:
                gates[request.match_info["pod"]] = condition["status"]
        if len(gates) == 2:
            gated.set()
        return web.json_response({"metadata": {"name": request.match_info["pod"]}})

    api = web.Application()
    api.router.add_patch(f"/apis/{GROUP}/{VERSION}/namespaces/ns/{PLURAL}/sync/status",
                         patch_status)  # fmt: skip
    api.router.add_patch("/api/v1/namespaces/ns/pods/{pod}/status", patch_pod_status)
    api_runner, api_port = await start(api)
    runners.append(api_runner)
    cluster = Cluster(f"http://127.0.0.1:{api_port}", raw, world)
    agents = AgentClient(timeout_seconds=5)
    settings = OperatorSettings(webhook_url="https://127.0.0.1:9")
    events: list[EventSpec] = []
    reconciler = Reconciler(cluster, agents, settings, lambda _, event: events.append(event),
                            b"key", indexes=Indexes())  # fmt: skip
    stage = Served(cluster, reconciler, answers, plans, written, gates, gated, events)
    try:
        yield stage
    finally:
        reconciler.forget(*KEY)
        await agents.close()
        await cluster.writer.close()
        for runner in runners:
            await runner.cleanup()


def test_a_first_pass_plans_writes_and_gates_and_the_next_keeps_its_generation() -> None:
    async def scenario() -> None:
        async with served() as stage:
            reconciler = stage.reconciler
            plans_before_token: list[int] = []
            stage.cluster.on_token = lambda: plans_before_token.append(len(stage.plans))
            result = await reconciler.run(*KEY)
            assert result.outcome is Outcome.OK
            assert len(stage.cluster.tokens) == 1
            # Before any plan: the pods the plans name cannot start without their token.
            assert plans_before_token == [0]
            [written] = stage.statuses
            assert written["groupGeneration"] == 1
            assert [m["pod"] for m in written["members"]] == list(POD_NAMES)
            memory = reconciler._memory[KEY]
            assert memory.sending is not None
            assert await memory.sending == {}  # every plan accepted
            assert sorted((p.generation, p.rank) for p in stage.plans) == [(1, 0), (1, 1), (1, 2)]
            assert memory.unsaved is not None  # the pass's soft state, adopted
            assert memory.unsaved.generation == 1
            assert reasons.GENERATION_PLANNED in [e.reason for e in stage.events]
            # The gates, after the status: no version yet, so both close.
            await asyncio.wait_for(stage.gated.wait(), SETTLED)
            assert stage.gates == {"e-1": "False", "e-2": "False"}

            # The agents form generation 1; the drift timer's sweep hears it.
            forming = GenerationState.FORMING
            stage.answers.update(
                {
                    "trainer-0": agent("trainer-0", Role.SOURCE, generations={1: (forming, 0)}),
                    "e-1": agent("e-1", generations={1: (forming, 1)}),
                    "e-2": agent("e-2", generations={1: (forming, 2)}),
                }
            )
            again = await reconciler.resync(*KEY)
            assert again.outcome is Outcome.OK
            assert len(stage.plans) == 3  # no new generation
            assert len(stage.cluster.tokens) == 1  # once per WeightSync object
            assert all(s["groupGeneration"] == 1 for s in stage.statuses)

    asyncio.run(scenario())


def test_a_failed_token_write_holds_back_neither_the_plans_nor_the_next_try() -> None:
    """The soft state counts a new generation delivered from the pass that planned it, so
    a token write that fails (early in the pass: pods cannot start without it) must not
    stop the plans going out; the next pass writes the token."""

    async def scenario() -> None:
        async with served() as stage:
            reconciler = stage.reconciler
            stage.cluster.token_error = ConnectionError("the API server is away")
            assert (await reconciler.run(*KEY)).outcome is Outcome.OK
            assert stage.cluster.tokens == []
            memory = reconciler._memory[KEY]
            assert memory.sending is not None
            assert await memory.sending == {}
            assert len(stage.plans) == 3
            assert [s["groupGeneration"] for s in stage.statuses] == [1]
            # The next pass writes the token and keeps the generation.
            assert (await reconciler.run(*KEY)).outcome is Outcome.OK
            assert len(stage.cluster.tokens) == 1
            assert len(stage.plans) == 3

    asyncio.run(scenario())
