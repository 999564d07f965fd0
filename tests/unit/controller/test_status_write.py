"""A pass that plans a new generation writes the status while the plans go out: the new
members show before the last plan is answered (a thousand plans take seconds), and a
refusal is written once every plan was sent (the API server's and the agents' HTTP,
served here)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from tests.support.serving import start
from tests.unit.controller.builders import agent, sink_view, source_view, sync
from tests.unit.controller.builders import reconciler as make_reconciler
from weightsync.api import GROUP, PLURAL, VERSION, ConditionType, find_condition, reasons
from weightsync.api.base import utc_now
from weightsync.api.control import ErrorResponse, MembershipPlan, PlanAccepted
from weightsync.api.v1alpha1 import WeightSyncStatus
from weightsync.controller.agents.client import AgentClient
from weightsync.controller.membership.plan import Desired, Slot, desired_members
from weightsync.controller.passes import apply
from weightsync.controller.passes.actions import StatusWrite, status_write
from weightsync.controller.passes.generations import Planned, Stored
from weightsync.controller.passes.memory import Memory
from weightsync.controller.passes.reconcile import Reconciler
from weightsync.controller.readiness.gates import Current
from weightsync.controller.status.observed import EventSpec, Observation, observed_status

WAIT = 10.0  # how long the slow member's plan waits for the status to arrive


Handler = Callable[[web.Request], Awaitable[web.Response]]


@dataclass
class Stage:
    """A reconciler between a served API server and served agents (trainer-0, e-1, e-2),
    generation 1 planned for them and its plans not sent yet."""

    reconciler: Reconciler
    raw: dict[str, Any]
    desired: Desired
    memory: Memory
    planned: list[Slot]
    observation: Observation

    def write(self) -> StatusWrite:
        """The pass's status write: the observation's status over an empty one."""
        made = observed_status(WeightSyncStatus(), self.observation, utc_now())
        return status_write(WeightSyncStatus(), made, self.observation)

    def send(self) -> asyncio.Task[dict[str, str]]:
        """The pass's delivery of generation 1's plans, as the apply step starts it."""
        deliver = self.reconciler.planner.deliver(
            self.raw, sync(), generation=1, desired=self.desired, token="t", memory=self.memory
        )
        return self.reconciler.applier.send_plans(("ns", "sync"), deliver, self.memory)


@contextlib.asynccontextmanager
async def staged(
    patch_status: Handler, put_plan: Handler, post_event: Callable[..., None]
) -> AsyncIterator[Stage]:
    api = web.Application()
    api.router.add_patch(f"/apis/{GROUP}/{VERSION}/namespaces/ns/{PLURAL}/sync/status",
                         patch_status)  # fmt: skip
    api_runner, api_port = await start(api)
    agents_app = web.Application()
    agents_app.router.add_put("/v1/plan", put_plan)
    agents_runner, port = await start(agents_app)
    agents = AgentClient(timeout_seconds=WAIT + 5)
    api_url = f"http://127.0.0.1:{api_port}"
    reconciler = make_reconciler(agents, api_url, post_event)  # type: ignore[arg-type]
    raw = {"metadata": {"namespace": "ns", "name": "sync", "generation": 3, "uid": "u",
                        "resourceVersion": "1"}}  # fmt: skip
    pods = [
        source_view(ip="127.0.0.1", agent_port=port),
        sink_view("e-1", ip="127.0.0.1", agent_port=port),
        sink_view("e-2", ip="127.0.0.1", agent_port=port, index=1),
    ]
    spec = sync().spec
    desired = desired_members(spec, pods, {p.name for p in pods}, [])
    memory = reconciler._memory[("ns", "sync")] = Memory()
    decided = reconciler.planner.plan(
        raw, Stored(WeightSyncStatus(), []), desired, {}, evidence={}, memory=memory,
        generation=None, plans_in_flight=False, now=time.monotonic(),
    )  # fmt: skip
    planned = decided.members
    assert (decided.generation, decided.fresh) == (1, True)
    observation = Observation(
        spec=spec, metadata_generation=3, pods=pods, statuses={},
        desired=desired, planned=planned, planned_generation=1, current=Current(None),
    )  # fmt: skip
    try:
        yield Stage(reconciler, raw, desired, memory, planned, observation)
    finally:
        await agents.close()
        await reconciler.kube.writer.close()
        await agents_runner.cleanup()
        await api_runner.cleanup()


def test_the_status_names_a_new_generation_while_its_plans_go_out_then_its_refusals() -> None:
    written: list[dict[str, Any]] = []  # status bodies, in order
    status_arrived = asyncio.Event()
    answered: list[tuple[int, bool]] = []  # (rank, whether the status had arrived)
    events: list[EventSpec] = []

    async def patch_status(request: web.Request) -> web.Response:
        body = await request.json()
        written.append(body["status"])
        status_arrived.set()
        meta = {"namespace": "ns", "name": "sync", "resourceVersion": str(1 + len(written))}
        return web.json_response({"metadata": meta, **body})

    async def put_plan(request: web.Request) -> web.Response:
        plan = MembershipPlan.model_validate_json(await request.read())
        if plan.rank == 2:  # e-2 refuses at once
            error = ErrorResponse(error="busy", detail="another plan is being applied")
            return web.Response(status=409, text=error.model_dump_json())
        if plan.rank == 1:  # e-1 answers only once the status is in (or after WAIT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(status_arrived.wait(), WAIT)
        answered.append((plan.rank, status_arrived.is_set()))
        accepted = PlanAccepted(generation=plan.generation, rank=plan.rank, world_size=3)
        return web.Response(status=202, text=accepted.model_dump_json())

    async def scenario() -> None:
        async with staged(patch_status, put_plan, lambda _, event: events.append(event)) as stage:
            memory = stage.memory
            assert set(memory.deliveries[1].members) == {"trainer-0", "e-1", "e-2"}
            last = await stage.reconciler.applier.write_status(
                stage.raw, stage.write(), stage.send(), memory
            )

        # e-1 answered its plan after the status named it: the write did not wait.
        assert sorted(answered) == [(0, True), (1, True)]
        first, second = written
        assert first["groupGeneration"] == second["groupGeneration"] == 1
        assert [m["pod"] for m in first["members"]] == ["trainer-0", "e-1", "e-2"]
        degraded = {c["type"]: c["reason"] for c in first["conditions"]}
        assert degraded.get(ConditionType.DEGRADED) != reasons.MEMBER_FAILED
        # The refusal, once every plan was sent: written, evented, the refuser benched.
        failed = find_condition(last.conditions, ConditionType.DEGRADED)
        assert failed is not None
        assert failed.reason == reasons.MEMBER_FAILED
        assert "e-2" in failed.message
        assert "busy" in failed.message
        assert {c["type"]: c["reason"] for c in second["conditions"]}[
            ConditionType.DEGRADED
        ] == reasons.MEMBER_FAILED
        assert reasons.PLAN_REJECTED in [e.reason for e in events]
        assert set(memory.cooldown) == {"uid-e-2"}
        # The second write was made on the first: the cache reads it back in order.
        assert memory.written is not None
        assert memory.written[0] == "2"
        assert memory.written[1]["metadata"]["resourceVersion"] == "3"

    asyncio.run(scenario())


def test_plans_answered_late_do_not_hold_the_pass_and_bring_one_once_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(apply, "PLANS_WAIT_SECONDS", 0.2)
    release = asyncio.Event()  # e-2 refuses its plan only once released

    async def patch_status(request: web.Request) -> web.Response:
        body = await request.json()
        meta = {"namespace": "ns", "name": "sync", "resourceVersion": "2"}
        return web.json_response({"metadata": meta, **body})

    async def put_plan(request: web.Request) -> web.Response:
        plan = MembershipPlan.model_validate_json(await request.read())
        if plan.rank == 2:
            await release.wait()
            error = ErrorResponse(error="busy", detail="another plan is being applied")
            return web.Response(status=409, text=error.model_dump_json())
        accepted = PlanAccepted(generation=plan.generation, rank=plan.rank, world_size=3)
        return web.Response(status=202, text=accepted.model_dump_json())

    async def scenario() -> None:
        async with staged(patch_status, put_plan, lambda *_: None) as stage:
            reconciler, memory, planned = stage.reconciler, stage.memory, stage.planned
            requested: list[tuple[str, str]] = []
            reconciler.request = lambda *key: requested.append(key)  # type: ignore[method-assign]

            def plan(evidence: dict[str, Any]) -> Planned:
                return reconciler.planner.plan(
                    stage.raw, Stored(WeightSyncStatus(), planned), stage.desired, evidence,
                    evidence=evidence, memory=memory, generation=1,
                    plans_in_flight=memory.sending is not None and not memory.sending.done(),
                    now=time.monotonic(),
                )  # fmt: skip

            sending = stage.send()
            try:
                written = await asyncio.wait_for(
                    reconciler.applier.write_status(stage.raw, stage.write(), sending, memory),
                    WAIT,
                )
                # The pass went on without e-2's answer; the status names the new members.
                assert not sending.done()
                assert [m.pod for m in written.members] == ["trainer-0", "e-1", "e-2"]
                # No newer generation while the plans go out, whatever the members said
                # before theirs came (e-1 answered holding none).
                assert plan({"e-1": agent("e-1")}) == Planned(planned, 1)
                release.set()
                assert await sending == {"e-2": "HTTP 409 busy: another plan is being applied"}
                await asyncio.sleep(0)  # the task's done callbacks
            finally:
                release.set()

            assert requested == [("ns", "sync")]  # their end brought a pass
            assert set(memory.cooldown) == {"uid-e-2"}  # the refuser sits out
            assert plan({"e-1": agent("e-1")}).fresh  # planning goes on

    asyncio.run(scenario())
