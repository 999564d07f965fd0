"""Builders for the controller's inputs: pods as the API server sends them, agent statuses,
an agent's status endpoint."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Callable
from typing import Any, Self

from aiohttp import web
from kubernetes import client

from tests.support.serving import start
from tests.unit.api.builders import weightsync
from weightsync.api import parse_weightsync
from weightsync.api.control import (
    AgentStatus,
    EngineStatus,
    GenerationState,
    GenerationStatus,
    RoundReport,
)
from weightsync.api.v1alpha1 import Role, WeightSync
from weightsync.controller import names
from weightsync.controller.agents.client import AgentClient
from weightsync.controller.cluster.events import EventPoster
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.membership.workloads import PodView, pod_view
from weightsync.controller.passes.reconcile import Reconciler
from weightsync.controller.settings import OperatorSettings


def sync(name: str = "sync", **paths: Any) -> WeightSync:
    """A parsed WeightSync (trainer `trainer`, inference `engine-a`), `paths` set by dotted path."""
    builder = weightsync(name).namespace("ns")
    for path, value in paths.items():
        builder.set(path.replace("__", "."), value)
    raw = builder.build()
    raw["metadata"]["uid"] = str(uuid.uuid4())
    return parse_weightsync(raw)


class PodBuilder:
    """A pod dict; `.running()` makes it a scheduled, addressed, containers-ready pod."""

    def __init__(self, name: str) -> None:
        self._pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": {}},
            "spec": {"containers": [{"name": "main", "image": "engine:1"}]},
            "status": {"phase": "Pending"},
        }

    def owned_by(self, kind: str, name: str, uid: str | None = None) -> Self:
        self._pod["metadata"]["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": uid or f"uid-{name}",
             "controller": True}
        ]  # fmt: skip
        return self

    def label(self, key: str, value: str) -> Self:
        self._pod["metadata"]["labels"][key] = value
        return self

    def running(self, ip: str = "10.0.0.1", node: str = "node-a", ready: bool = True) -> Self:
        self._pod["spec"]["nodeName"] = node
        self._pod["status"] = {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "ContainersReady", "status": "True" if ready else "False"}],
        }
        return self

    def injected(self, *, gate: bool = False) -> Self:
        self._pod["spec"]["initContainers"] = [
            {"name": names.AGENT_CONTAINER, "restartPolicy": "Always"}
        ]
        self._pod["metadata"]["annotations"] = {names.AGENT_PORT_ANNOTATION: "8470"}
        if gate:
            self._pod["spec"]["readinessGates"] = [{"conditionType": names.WEIGHTS_CURRENT}]
        return self

    def gate(self, status: str, reason: str) -> Self:
        self._pod["status"].setdefault("conditions", []).append(
            {"type": names.WEIGHTS_CURRENT, "status": status, "reason": reason,
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        )  # fmt: skip
        return self

    def set(self, path: str, value: Any) -> Self:
        *parents, leaf = path.split(".")
        node = self._pod
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        return self

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self._pod)


def pod(name: str) -> PodBuilder:
    return PodBuilder(name)


def source_view(name: str = "trainer-0", ip: str = "10.0.0.1", **changes: Any) -> PodView:
    raw = pod(name).owned_by("StatefulSet", "trainer").running(ip).injected().build()
    changes.setdefault("rank", changes.get("ordinal", 0))  # one rank per pod
    return _replace(pod_view(raw, Role.SOURCE, "trainer", None, 0), changes)


def sink_view(name: str, ip: str = "10.0.1.1", index: int = 0, **changes: Any) -> PodView:
    raw = pod(name).owned_by("ReplicaSet", "engine-a-abc").running(ip).injected(gate=True).build()
    return _replace(pod_view(raw, Role.SINK, "engine-a", index, None), changes)


def _replace(view: PodView, changes: dict[str, Any]) -> PodView:
    from dataclasses import replace

    return replace(view, **changes)


def agent(
    pod_name: str,
    role: Role = Role.SINK,
    *,
    generations: dict[int, tuple[GenerationState, int]] | None = None,
    version: int | None = None,
    engine_version: int | None = None,
    torn: bool = False,
    round_in_progress: bool = False,
    last_round: RoundReport | None = None,
    lineage: str | None = None,
    engine_healthy: bool = True,
    holding: int | None = None,
) -> AgentStatus:
    """An agent's status; `generations` maps number -> (state, rank)."""
    held = [
        GenerationStatus(generation=number, state=state, rank=rank, world_size=2)
        for number, (state, rank) in sorted((generations or {}).items())
    ]
    engine = None
    if role is Role.SINK:
        engine = EngineStatus(
            healthy=engine_healthy, version=engine_version, torn=torn, lineage=lineage
        )
    active = [g.generation for g in held if g.state is GenerationState.ACTIVE]
    return AgentStatus(
        pod=pod_name,
        role=role,
        generation=active[-1] if active else None,
        warm=bool(active),
        version=version,
        lineage=lineage,
        round_in_progress=round_in_progress,
        generations=held,
        engine=engine,
        last_round=last_round,
        holding=holding,
        holding_lineage=lineage if holding is not None else None,
    )


def round_report(version: int, *, ok: bool = True, reason: str = "") -> RoundReport:
    return RoundReport(
        version=version,
        generation=1,
        ok=ok,
        duration_millis=120,
        bytes=4096,
        bandwidth_bytes_per_second=34133,
        reason=reason,
        message="" if ok else f"{reason} on rank 2",
        finished_at_unix_millis=1_767_225_600_500,
    )


async def agent_server(
    pod: str, delay: float, answer: Callable[[], AgentStatus] | None = None
) -> tuple[web.AppRunner, int]:
    """A real HTTP server answering `GET /v1/status` as `pod`'s agent after `delay` s
    (on 127.0.0.1; its port), with `answer()` when given, read at each request."""

    async def status(_: web.Request) -> web.Response:
        await asyncio.sleep(delay)
        said = answer() if answer is not None else agent(pod)
        return web.Response(text=said.model_dump_json(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/status", status)
    return await start(app)


def reconciler(
    agents: AgentClient,
    api: str = "http://127.0.0.1:9",
    post_event: EventPoster | None = None,
) -> Reconciler:
    """A reconciler asking `agents` and writing to the API server at `api` (by default
    none: nothing listens on port 9), its Events posted by `post_event` when given."""
    kube = Kube(client.ApiClient(client.Configuration(host=api)))
    settings = OperatorSettings(webhook_url="https://127.0.0.1:9")
    return Reconciler(kube, agents, settings, post_event or EventPoster(kube), b"key")
