"""The observe step of a pass: everything it reads, in one immutable `Observed`.

A pass reads what it acts on (nothing it decides depends on an earlier pass in this
process): the WeightSync (the newest this process knows, `Observer.read`), the other
WeightSyncs, the workloads and their pods from the watches (`cache`), and the agents'
latest `GET /v1/status` answers (`agentview`: swept by the drift timer, the trainer's
asked every second; new agents asked here). It stops at the first problem that leaves
nothing to decide but a Ready=False (`Blocked`). It writes nothing to the API server or
the agents: that is the apply step's (`apply`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from weightsync.api import parse_weightsync, reasons
from weightsync.api.base import utc_now
from weightsync.api.v1alpha1 import Role, WeightSync, WeightSyncStatus
from weightsync.api.validation import WeightSyncInvalidError
from weightsync.controller.agents.client import AgentAddress, AgentClient
from weightsync.controller.agents.view import AgentView
from weightsync.controller.cluster import tokens
from weightsync.controller.cluster.cache import Indexes, newest
from weightsync.controller.cluster.kube import Kube, NotCachedError
from weightsync.controller.cluster.pod_actions import WEBHOOK_SETTLE_SECONDS
from weightsync.controller.membership.owners import WorkloadRef, workload_refs
from weightsync.controller.membership.workloads import (
    PodView,
    World,
    parse_time,
    planned_sources,
    sync_pods,
)
from weightsync.controller.passes.actions import Outcome
from weightsync.controller.passes.memory import Memory
from weightsync.controller.runtime.tasks import Tasks
from weightsync.controller.runtime.timing import WORKLOAD_GRACE_SECONDS
from weightsync.controller.settings import OperatorSettings
from weightsync.controller.status.problems import claimed, stored_status, unmet

WORKLOAD_GRACE = timedelta(seconds=WORKLOAD_GRACE_SECONDS)

# How long a pass waits for new agents' first answers; the late ones are recorded when
# they come, and bring a pass of their own.
NEWCOMER_WAIT_SECONDS = 1.0

Key = tuple[str, str]  # (namespace, name) of a WeightSync


@dataclass(frozen=True, slots=True)
class Blocked:
    """What stopped the pass before the agents: Ready=False with this reason."""

    outcome: Outcome  # INVALID (the spec or a claim: until it changes) or WAITING
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Observed:
    """What one pass read (the input of `decide.decide`); nothing in it changes after.
    Of a `blocked` pass, only the first five fields and the token's are read."""

    raw: Mapping[str, Any]  # the WeightSync as stored
    old: WeightSyncStatus  # its status, parsed
    generation: int  # its metadata.generation
    at: datetime  # when the reads ended (UTC: the status's timestamps)
    blocked: Blocked | None = None
    sync: WeightSync | None = None  # parsed, less its status
    pods: list[PodView] = field(default_factory=list)  # the workloads' (`sync_pods`)
    replicas: int = 0  # the inference pods the Deployments ask for
    sources: list[int] = field(default_factory=list)  # the trainer ranks to plan
    agents: AgentView = field(default_factory=AgentView)  # the answers, a snapshot
    now: float = 0.0  # when the reads ended (monotonic: the clocks of the soft state)
    token: str = ""  # the agents' control-API token for this WeightSync
    token_written: bool = True  # this process applied its token Secret already
    plans_in_flight: bool = False  # a generation's plans still go out (`Memory.sending`)
    agent_port: int = 0  # the agents' port where a pod names none
    webhook_settling: tuple[datetime, datetime] | None = None  # see `pods.uninjected`


def without_status(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The WeightSync less its status and `metadata.managedFields`: what a pass parses."""
    meta = {k: v for k, v in raw["metadata"].items() if k != "managedFields"}
    return {**{k: v for k, v in raw.items() if k != "status"}, "metadata": meta}


def cached_status(raw: Mapping[str, Any], memory: Memory) -> WeightSyncStatus:
    """The stored status, parsed once per version of the WeightSync: a thousand members
    took a fifth of a pass's CPU, and most passes read the version the last one did."""
    version = raw["metadata"].get("resourceVersion")
    if version is not None and memory.stored is not None and memory.stored[0] == version:
        return memory.stored[1]
    old = stored_status(raw)
    memory.stored = (version, old) if version is not None else None
    return old


class Observer:
    """Reads a pass's `Observed`; `request` asks for a pass (late answers bring one)."""

    def __init__(
        self,
        kube: Kube,
        indexes: Indexes,
        agents: AgentClient,
        settings: OperatorSettings,
        token_key: bytes,
        *,
        request: Callable[[str, str], None],
        tasks: Tasks | None = None,
    ) -> None:
        self.kube, self.indexes, self.agents = kube, indexes, agents
        self.settings, self.token_key, self.request = settings, token_key, request
        self.tasks = tasks or Tasks()
        # Pods admitted meanwhile may have met no webhook of ours (`pods.uninjected`).
        started = utc_now()
        self.webhook_settling = (started, started + timedelta(seconds=WEBHOOK_SETTLE_SECONDS))

    async def observe(self, key: Key, memory: Memory) -> Observed | None:
        """The pass's observation; None when the WeightSync is gone or being deleted."""
        namespace, name = key
        laps = memory.laps
        raw = await self.read(namespace, name, memory)
        laps("read")
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return None
        generation = int(raw["metadata"].get("generation") or 0)
        old = cached_status(raw, memory)

        def blocked(outcome: Outcome, problem: tuple[str, str], token: str = "") -> Observed:
            return Observed(
                raw, old, generation, utc_now(), Blocked(outcome, *problem),
                token=token,
                token_written=not token or memory.token_written_for == raw["metadata"]["uid"],
            )  # fmt: skip

        try:
            # Without the status (`old` has it: a thousand members) nor the field managers'
            # records: while members was a list keyed by rank those were as long, and
            # parsing them took 22 ms a pass, a third of a pass's CPU at make scale.
            sync = parse_weightsync(without_status(raw))
        except WeightSyncInvalidError as error:
            message = reasons.INVALID_SPEC_MESSAGE.format(errors=error)
            return blocked(Outcome.INVALID, (reasons.INVALID_SPEC, message))
        listing = self.indexes.weightsyncs(namespace)
        if listing is None:  # no handler has bound the watch's index yet
            listing = await asyncio.to_thread(self.kube.list_weightsyncs, namespace)
        problem = claimed(raw, sync, listing)
        if problem is not None:
            return blocked(Outcome.INVALID, problem)
        world = await self.world(namespace, *workload_refs(sync))
        laps("observe")
        token = tokens.derive(self.token_key, namespace, sync.metadata.name or "")
        # Applied together with its workloads, a WeightSync may come first: for a moment
        # a workload it names is pending, not missing (no Warning for a normal apply).
        created = parse_time(raw["metadata"].get("creationTimestamp"))
        young = created is not None and utc_now() - created < WORKLOAD_GRACE
        grace = WORKLOAD_GRACE.total_seconds() if young else None
        absent = unmet(sync, world.trainer, world.engines, pending_for=grace)
        if absent is not None:  # its pods may come with the workload: their token first
            return blocked(Outcome.WAITING, absent, token)
        pods = sync_pods(sync, world)
        seen = await self.answers(key, pods, token, memory)
        laps("answers")
        sending = memory.sending
        return Observed(
            raw, old, generation, utc_now(),
            sync=sync,
            pods=pods,
            replicas=world.inference_replicas,
            sources=planned_sources(sync, world, pods),
            agents=seen,
            now=time.monotonic(),
            token=token,
            token_written=memory.token_written_for == raw["metadata"]["uid"],
            plans_in_flight=sending is not None and not sending.done(),
            agent_port=self.settings.agent_http_port,
            webhook_settling=self.webhook_settling,
        )  # fmt: skip

    async def read(self, namespace: str, name: str, memory: Memory) -> Mapping[str, Any] | None:
        """The WeightSync as stored, from the watch when it holds the newest version this
        process knows of (`cache.newest`), else by a GET: the status a pass rewrites is
        never older than its own last write."""
        watched = self.indexes.weightsync(namespace, name)
        found = newest(watched[0] if watched else None, memory.seen_version, memory.written)
        if found is None:
            found = await asyncio.to_thread(self.kube.get_weightsync, namespace, name)
        memory.seen_version = found["metadata"].get("resourceVersion") if found else None
        return found

    async def world(
        self, namespace: str, trainer: WorkloadRef, engines: list[WorkloadRef]
    ) -> World:
        """The workloads and their pods: from the watches, on the loop (a thread may
        queue behind others for seconds under load), else (not cached yet) listed."""
        try:
            return self.kube.observe(namespace, trainer, engines, self.indexes, cached_only=True)
        except NotCachedError:
            return await asyncio.to_thread(
                self.kube.observe, namespace, trainer, engines, self.indexes
            )

    async def answers(self, key: Key, pods: list[PodView], token: str, memory: Memory) -> AgentView:
        """The agents' latest answers (`agentview`), new pods' asked now; one set for the
        whole pass (a snapshot), whatever a sweep records meanwhile. New pods' answers are
        waited for up to `NEWCOMER_WAIT_SECONDS`: one agent slow to answer (a timeout is
        seconds) must not hold up the pass for everyone else. Records what the sweeps
        poll (`Memory.addresses`)."""
        addresses = self.addresses(pods)
        view = memory.agents
        view.retain({a.pod for a in addresses})
        memory.addresses, memory.token = addresses, token
        memory.sources = frozenset(p.name for p in pods if p.role is Role.SOURCE)
        unpolled = set(view.unpolled(a.pod for a in addresses)) - memory.asking
        newcomers = [a for a in addresses if a.pod in unpolled]
        if newcomers:
            task = self.tasks.spawn(
                f"ask {key[0]}/{key[1]}", self._ask(key, newcomers, token, memory)
            )
            memory.asks.add(task)
            task.add_done_callback(memory.asks.discard)
            await asyncio.wait({task}, timeout=NEWCOMER_WAIT_SECONDS)
        return view.snapshot()

    async def _ask(self, key: Key, agents: list[AgentAddress], token: str, memory: Memory) -> None:
        """Poll new agents into the view, each answer recorded as it comes (the pass
        reads those in by its deadline); a pass once answers came after it went on."""
        memory.asking |= {a.pod for a in agents}
        started = time.monotonic()

        async def ask(address: AgentAddress) -> None:
            try:
                await self.agents.poll(memory.agents, [address], token)
            finally:
                memory.asking.discard(address.pod)

        await asyncio.gather(*(ask(a) for a in agents))
        if time.monotonic() - started >= NEWCOMER_WAIT_SECONDS:
            self.request(*key)

    def addresses(self, pods: list[PodView]) -> list[AgentAddress]:
        """The agents a pass can ask: running pods with the sidecar and an IP."""
        return [
            AgentAddress(p.name, p.ip, p.agent_port or self.settings.agent_http_port)
            for p in pods
            if p.has_agent and p.ip and p.running and not p.terminating
        ]
