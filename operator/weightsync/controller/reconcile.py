"""One level-based reconcile pass over a WeightSync, and the per-object bookkeeping around it.

A pass reads what it acts on (nothing it decides depends on an earlier pass in this
process): the WeightSync (the newest this process knows, `_read`), the other
WeightSyncs, the workloads and their pods from the watches (`cache`), and the agents'
latest `GET /v1/status` answers (`agentview`: swept by the drift timer, `resync`; the
trainer's asked every second, `watch_sources`; new agents asked by the pass). It decides
with the pure modules (`plan`, `readiness`, `recovery`, `status`) and acts: starts P2P
recoveries of pods that are behind (held out of the group until done), writes the
status (while the plans of a new generation go out with `PUT /v1/plan`, if membership
changed; once more if a member refused its plan), posts Events, then hands the readiness
gates to a background writer (`gatesync`): status first, so `kubectl get wsync` never
lags them.

Soft state only (`memory`): the agents' answers (a restart polls them again), when a
generation was planned (a restart restarts the pre-warm clock), cooldowns, recovery
trackers (a restart may report a finished recovery once more), gate writes in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from enum import StrEnum
from typing import Any

from weightsync.api import parse_weightsync, reasons
from weightsync.api.base import utc_now
from weightsync.api.control import AgentStatus
from weightsync.api.v1alpha1 import Role, SyncMode, WeightSync, WeightSyncStatus
from weightsync.api.validation import WeightSyncInvalidError
from weightsync.controller import metrics, tokens
from weightsync.controller import pods as pod_actions
from weightsync.controller.agents import AgentAddress, AgentClient
from weightsync.controller.agentview import AgentView
from weightsync.controller.cache import Indexes, newest
from weightsync.controller.gatesync import GateSync
from weightsync.controller.generations import Planner
from weightsync.controller.kube import Kube, NotCachedError, api_unavailable
from weightsync.controller.memory import Laps, Memory
from weightsync.controller.plan import (
    Desired,
    Slot,
    desired_members,
    forming,
    intact,
    newcomers_wait,
)
from weightsync.controller.pods import EventPoster
from weightsync.controller.problems import Problem, claimed, stored_status, unmet
from weightsync.controller.readiness import (
    Current,
    GateDecision,
    current_version,
    gate_changes,
    round_vouches,
    rounds_reach,
)
from weightsync.controller.recoveries import RecoveryPass, run_recoveries
from weightsync.controller.scheduling import PassScheduler
from weightsync.controller.settings import OperatorSettings
from weightsync.controller.status import (
    Observation,
    observed_status,
    problem_status,
)
from weightsync.controller.transitions import transition_events
from weightsync.controller.workloads import PodView, World, planned_sources, sync_pods

log = logging.getLogger(__name__)

SLOW_PASS_SECONDS = 2.0  # a pass this long logs where its time went

RECOVERY_POLL_SECONDS = 1.0  # how soon a pass follows one that left a recovery running
# How long a pass waits for new agents' first answers; the late ones are recorded when
# they come, and bring a pass of their own.
NEWCOMER_WAIT_SECONDS = 1.0
# How long a pass that planned a new generation waits for its plans to be answered; the
# rest go on, and their end brings a pass (refusals sit out, a new generation follows).
PLANS_WAIT_SECONDS = 1.0
EVENT_PASS_DELAY_SECONDS = 0.5  # a pod event's pass waits this long for the rest of a burst
SOURCE_POLL_SECONDS = 1.0  # how often the trainer's agents are asked (`watch_sources`)


class Outcome(StrEnum):
    OK = "ok"
    WAITING = "waiting"  # a referenced workload is missing: retry slowly
    INVALID = "invalid"  # the spec is wrong: nothing to do until it changes
    GONE = "gone"  # deleted, or being deleted


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    message: str = ""


def _round_word(status: AgentStatus | None) -> tuple[object, ...] | None:
    """What a source says about rounds: its version and its last round's report."""
    return None if status is None else (status.version, status.lineage, status.last_round)


def without_status(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The WeightSync less its status and `metadata.managedFields`: what a pass parses."""
    meta = {k: v for k, v in raw["metadata"].items() if k != "managedFields"}
    return {**{k: v for k, v in raw.items() if k != "status"}, "metadata": meta}


def log_pass_failure(what: str, error: BaseException) -> None:
    """A pass that failed outside kopf's retries (a timer, a follow-up): one line when the
    API server is away (the next pass retries), the traceback for anything else."""
    if api_unavailable(error):
        log.warning("%s: the API server is unavailable (%s); the next pass retries", what, error)
    elif isinstance(error, TimeoutError):  # `scheduling.PASS_TIMEOUT_SECONDS`
        log.warning("%s: stuck, cancelled; the next pass retries", what)
    else:
        log.error("%s failed", what, exc_info=error)


class Reconciler:
    """Runs passes, one at a time per WeightSync (`scheduling`), and follows recoveries up."""

    def __init__(
        self,
        kube: Kube,
        agents: AgentClient,
        settings: OperatorSettings,
        post_event: EventPoster,
        token_key: bytes,
        *,
        indexes: Indexes | None = None,
    ) -> None:
        self.kube = kube
        self.indexes = indexes or Indexes()
        self.agents = agents
        self.settings = settings
        self.token_key = token_key
        self.post_event = post_event
        self._memory: dict[tuple[str, str], Memory] = {}
        self.planner = Planner(agents, settings, post_event)
        self._scheduler: PassScheduler[tuple[str, str], Result] = PassScheduler(
            self._measured, request_delay=EVENT_PASS_DELAY_SECONDS
        )
        # Pods admitted meanwhile may have met no webhook of ours (`pods_to_recreate`).
        started = utc_now()
        self.webhook_settling = (
            started,
            started + timedelta(seconds=pod_actions.WEBHOOK_SETTLE_SECONDS),
        )

    def forget(self, namespace: str, name: str) -> None:
        memory = self._memory.pop((namespace, name), None)
        if memory is not None and memory.poll is not None:
            memory.poll.cancel()
        if memory is not None and memory.sending is not None:
            memory.sending.cancel()
        self._scheduler.forget((namespace, name))
        metrics.forget(namespace, name)

    def _poll_later(self, namespace: str, name: str, memory: Memory) -> None:
        """Run another pass soon: a recovery's progress shows in no pod event."""
        if memory.poll is None or memory.poll.done():
            memory.poll = asyncio.get_running_loop().create_task(
                self._poll(namespace, name, memory), name=f"poll {namespace}/{name}"
            )

    async def _poll(self, namespace: str, name: str, memory: Memory) -> None:
        await asyncio.sleep(RECOVERY_POLL_SECONDS)
        memory.poll = None  # this pass may schedule the next one
        try:
            watched = [a for a in memory.addresses if a.pod in memory.watched]
            await self.agents.poll(memory.agents, watched, memory.token)
            await self.run(namespace, name)
        except Exception as error:
            log_pass_failure(f"follow-up pass of {namespace}/{name}", error)

    async def run(self, namespace: str, name: str) -> Result:
        """The result of a pass that started after this call (see `scheduling`)."""
        return await self._scheduler.run((namespace, name))

    def request(self, namespace: str, name: str) -> None:
        """A pass soon, not waited for (pod events); a failure is logged."""
        self._scheduler.request(
            (namespace, name),
            lambda key, error: log_pass_failure(f"pass for {key[0]}/{key[1]}", error),
        )

    async def resync(self, namespace: str, name: str) -> Result:
        """The drift timer's tick: poll every agent the last pass knew (a *sweep*, apart
        from the pass; sweeps never overlap), then a pass."""
        memory = self._memory.get((namespace, name))
        if memory is not None and memory.addresses:
            async with memory.sweeping:
                await self.agents.poll(memory.agents, memory.addresses, memory.token, sweep=True)
        return await self.run(namespace, name)

    async def watch_sources(self, namespace: str, name: str) -> None:
        """The source timer's tick (`SOURCE_POLL_SECONDS`): ask the trainer's agents alone,
        a few whatever the group's size, and when one's answer changed, pass now rather
        than at the drift timer's next tick: a version published, a round's report or a
        generation turned warm shows a second or two after it. A new version or round
        sweeps first (`resync`): the engines' answers from before the round would close
        gates of engines it reached. Other changes do not: at a scale-up the sources'
        generations change every few seconds, and a thousand more polls each time
        overran the agents' timeout."""
        memory = self._memory.get((namespace, name))
        if memory is None:
            return
        sources = [a for a in memory.addresses if a.pod in memory.sources]
        if not sources:
            return
        view = memory.agents
        before = {a.pod: (view.statuses.get(a.pod), view.errors.get(a.pod)) for a in sources}
        await self.agents.poll(view, sources, memory.token)
        changed = [
            p for p, said in before.items() if (view.statuses.get(p), view.errors.get(p)) != said
        ]
        if not changed:
            return
        if any(_round_word(view.statuses.get(p)) != _round_word(before[p][0]) for p in changed):
            await self.resync(namespace, name)
        else:  # a generation's state: the sources' word alone decides (`plan.forming`)
            await self.run(namespace, name)

    async def _measured(self, key: tuple[str, str]) -> Result:
        namespace, name = key
        memory = self._memory.setdefault(key, Memory())
        memory.poll_soon = False
        memory.laps = laps = Laps()
        try:
            result = await self._pass(namespace, name, memory)
        except Exception:
            metrics.RECONCILES.labels("error").inc()
            raise
        finally:
            laps("end")
            metrics.RECONCILE_DURATION.observe(laps.total)
            if laps.total >= SLOW_PASS_SECONDS:
                log.info("slow pass of %s/%s: %.1f s (%s)", namespace, name, laps.total, laps)
        metrics.RECONCILES.labels(result.outcome.value).inc()
        if result.outcome is Outcome.GONE:
            self._memory.pop(key, None)  # a pod event named it late
        elif memory.poll_soon:
            self._poll_later(namespace, name, memory)
        return result

    # -- the pass --------------------------------------------------------------------

    async def _pass(self, namespace: str, name: str, memory: Memory) -> Result:
        laps = memory.laps
        raw = await self._read(namespace, name, memory)
        laps("read")
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return Result(Outcome.GONE)
        generation = int(raw["metadata"].get("generation") or 0)
        old = self._stored(raw, memory)
        try:
            # Without the status (`old` has it: a thousand members) nor the field managers'
            # records: while members was a list keyed by rank those were as long, and
            # parsing them took 22 ms a pass, a third of a pass's CPU at make scale.
            sync = parse_weightsync(without_status(raw))
        except WeightSyncInvalidError as error:
            message = reasons.INVALID_SPEC_MESSAGE.format(errors=error)
            await self._problem(raw, old, generation, (reasons.INVALID_SPEC, message))
            return Result(Outcome.INVALID, message)
        listing = self.indexes.weightsyncs(namespace)
        if listing is None:  # no handler has bound the watch's index yet
            listing = await asyncio.to_thread(self.kube.list_weightsyncs, namespace)
        problem = claimed(raw, sync, listing)
        if problem is not None:
            await self._problem(raw, old, generation, problem)
            return Result(Outcome.INVALID, problem[1])
        spec = sync.spec
        trainer = spec.trainer.stateful_set_ref.name
        deployments = [entry.deployment_ref.name for entry in spec.inference]
        world = await self._observe(namespace, trainer, deployments)
        laps("observe")
        absent = unmet(sync, world.statefulset, world.deployments)
        if absent is not None:
            await self._problem(raw, old, generation, absent)
            return Result(Outcome.WAITING, absent[1])
        token = tokens.derive(self.token_key, namespace, sync.metadata.name or "")
        uid = raw["metadata"]["uid"]
        if memory.token_written_for != uid:  # once per WeightSync object (and per restart)
            await asyncio.to_thread(self.kube.write_token, namespace, raw, token)
            memory.token_written_for = uid
        pods = sync_pods(sync, world)
        await pod_actions.recreate_uninjected(
            self.kube, self.post_event, raw, pods, self.webhook_settling
        )
        laps("pods")
        seen = await self._answers((namespace, name), pods, token, memory)
        laps("answers")
        statuses, errors = seen.statuses, seen.errors
        sources = planned_sources(sync, world, pods)
        desired, (planned, planned_generation, fresh), timed_out = await self._group(
            raw, sync, pods, (statuses, old), token=token, memory=memory, sources=sources,
            replicas=world.inference_replicas,
        )  # fmt: skip

        current, gates = self._readiness(spec.mode, planned, pods, seen, old=old, memory=memory)
        observation = Observation(
            spec=spec,
            metadata_generation=generation,
            pods=pods,
            statuses=statuses,
            desired=desired,
            planned=planned,
            planned_generation=planned_generation,
            current=current,
            prewarm_timed_out=timed_out,
            agent_errors=errors,
            sources=sources,
        )
        laps("decide")
        sending = None
        if fresh and planned_generation is not None:
            sending = self._send_plans(
                (namespace, name),
                self.planner.deliver(
                    raw, sync, generation=planned_generation, desired=desired, token=token,
                    memory=memory,
                ),
                memory,
            )  # fmt: skip
        new = await self._write_observed(raw, old, observation, sending)
        laps("status" if sending is None else "status, plans")
        # Status first, then the gates, written in the background: the next pass need
        # not wait for a thousand of them (`gatesync`).
        if memory.gates is None:
            memory.gates = GateSync(self.kube.writer, namespace)
        memory.gates.submit(pods, gates)
        metrics.record_status(namespace, name, new)
        return Result(Outcome.OK)

    @staticmethod
    def _stored(raw: Mapping[str, Any], memory: Memory) -> WeightSyncStatus:
        """The stored status, parsed once per version of the WeightSync: a thousand
        members took a fifth of a pass's CPU, and most passes read the version the last
        one did."""
        version = raw["metadata"].get("resourceVersion")
        if version is not None and memory.stored is not None and memory.stored[0] == version:
            return memory.stored[1]
        old = stored_status(raw)
        memory.stored = (version, old) if version is not None else None
        return old

    async def _observe(self, namespace: str, trainer: str, deployments: list[str]) -> World:
        """The workloads and their pods: from the watches, on the loop (a thread may
        queue behind others for seconds under load), else (not cached yet) listed."""
        try:
            return self.kube.observe(
                namespace, trainer, deployments, self.indexes, cached_only=True
            )
        except NotCachedError:
            return await asyncio.to_thread(
                self.kube.observe, namespace, trainer, deployments, self.indexes
            )

    def _readiness(
        self,
        mode: SyncMode,
        planned: list[Slot],
        pods: list[PodView],
        seen: AgentView,
        *,
        old: WeightSyncStatus,
        memory: Memory,
    ) -> tuple[Current, list[GateDecision]]:
        """The current version (the planned source's word) and the gates to change."""
        statuses = seen.statuses
        source_pod = next((s.pod for s in planned if s.role is Role.SOURCE), None)
        source = statuses.get(source_pod) if source_pod is not None else None
        current = current_version(source, Current(old.current_version, old.lineage))
        # Colocated engines are no members: the source loads them whatever the generation.
        reached, vouched = None, frozenset[str]()
        if mode is not SyncMode.COLOCATED:
            reached = rounds_reach(source, statuses, memory.unheard(seen))
            since = seen.first_said(source_pod, source) if source_pod and source else None
            vouched = round_vouches(source, current, statuses, seen.heard_at, since)
        gates = gate_changes(
            pods, statuses, seen.errors, current, reached=reached, vouched=vouched,
            source_unheard=source_pod is not None and source is None,
        )  # fmt: skip
        return current, gates

    async def _read(self, namespace: str, name: str, memory: Memory) -> Mapping[str, Any] | None:
        """The WeightSync as stored, from the watch when it holds the newest version this
        process knows of (`cache.newest`), else by a GET: the status a pass rewrites is
        never older than its own last write."""
        watched = self.indexes.weightsync(namespace, name)
        found = newest(watched[0] if watched else None, memory.seen_version, memory.written)
        if found is None:
            found = await asyncio.to_thread(self.kube.get_weightsync, namespace, name)
        memory.seen_version = found["metadata"].get("resourceVersion") if found else None
        return found

    async def _answers(
        self, key: tuple[str, str], pods: list[PodView], token: str, memory: Memory
    ) -> AgentView:
        """The agents' latest answers (`agentview`), new pods' asked now; one set for the
        whole pass (a snapshot), whatever a sweep records meanwhile. New pods' answers are
        waited for up to `NEWCOMER_WAIT_SECONDS`: one agent slow to answer (a timeout is
        seconds) must not hold up the pass for everyone else."""
        addresses = self._addresses(pods)
        view = memory.agents
        view.retain({a.pod for a in addresses})
        memory.addresses, memory.token = addresses, token
        memory.sources = frozenset(p.name for p in pods if p.role is Role.SOURCE)
        unpolled = set(view.unpolled(a.pod for a in addresses)) - memory.asking
        newcomers = [a for a in addresses if a.pod in unpolled]
        if newcomers:
            task = asyncio.get_running_loop().create_task(
                self._ask(key, newcomers, token, memory), name=f"ask {key[0]}/{key[1]}"
            )
            memory.asks.add(task)
            task.add_done_callback(memory.asks.discard)
            await asyncio.wait({task}, timeout=NEWCOMER_WAIT_SECONDS)
        return view.snapshot()

    async def _ask(
        self, key: tuple[str, str], agents: list[AgentAddress], token: str, memory: Memory
    ) -> None:
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

    async def _group(
        self,
        raw: Mapping[str, Any],
        sync: WeightSync,
        pods: list[PodView],
        seen: tuple[dict[str, AgentStatus], WeightSyncStatus],
        *,
        token: str,
        memory: Memory,
        sources: list[int],
        replicas: int,
    ) -> tuple[Desired, tuple[list[Slot], int | None, bool], bool]:
        """Recoveries, then the members wanted (`sources`: the trainer ranks), the
        generation planned (a new one if the group must change: its plans not sent yet),
        and whether it is past its pre-warm timeout. `replicas`: the inference pods the
        Deployments ask for."""
        statuses, old = seen
        spec, view, now = sync.spec, memory.agents, time.monotonic()
        memory.cooldown = {uid: t for uid, t in memory.cooldown.items() if t > now}
        cooling = {p.name for p in pods if p.uid in memory.cooldown}
        recovering = await self._recover(
            raw, sync, pods, seen, token=token, memory=memory, sources=sources
        )
        memory.laps("recover")
        excluded = cooling | recovering.held_out
        generation, previous = memory.planned(
            old.group_generation, [Slot(m.rank, m.pod, m.role) for m in old.members]
        )
        # Answers to requests sent since the planned generation was delivered: the only
        # evidence about it (all of them after a restart: it was delivered before).
        evidence = view.since(memory.planned_at.get(generation or 0))
        # Members whose polls time out keep their places while nothing shows the group
        # broken; once it is, a new generation without them is due anyway.
        unknown = (
            view.unknown(now, float(spec.prewarm.timeout_seconds))
            if intact(previous, generation, evidence)
            else frozenset()
        )
        # Colocated: the engine pod the planned group feeds, as its source agent says.
        planned_source = next((s.pod for s in previous if s.role is Role.SOURCE), None)
        source_status = statuses.get(planned_source) if planned_source else None
        planned_engine = source_status.local_engine if source_status else None
        desired = desired_members(
            spec, pods, statuses.keys(), previous, sources=sources,
            excluded=excluded, previous_engine=planned_engine, unknown=unknown,
        )  # fmt: skip
        # Newcomers, since when: they may wait a while for more pods (`newcomers_wait`).
        names = {slot.pod for slot in previous}
        if all(m.name in names for m in desired.members):
            memory.newcomers_since = None
        elif memory.newcomers_since is None:
            memory.newcomers_since = now
        batching = memory.newcomers_since is not None and newcomers_wait(
            pods, desired, previous, cooling=cooling,
            waiting_for=now - memory.newcomers_since, replicas=replicas,
        )  # fmt: skip
        planned = self.planner.plan(
            raw, (old, previous, planned_engine), desired, statuses,
            evidence=evidence, memory=memory, generation=generation, batching=batching,
        )  # fmt: skip
        memory.laps("plan")
        if planned[1] != generation:  # a new generation took the newcomers in
            memory.newcomers_since = None
        elif memory.newcomers_since is not None and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: %d newcomers wait %.1f s (more pods on their way: %s; generation %s"
                " still forming: %s)", raw["metadata"]["name"],
                sum(1 for m in desired.members if m.name not in names),
                now - memory.newcomers_since, batching, generation,
                generation is not None and forming(previous, generation, evidence),
            )  # fmt: skip
        evidence = view.since(memory.planned_at.get(planned[1] or 0))
        timed_out = self.planner.prewarm_timed_out(sync, planned[:2], evidence, pods, memory)
        return desired, planned, timed_out

    async def _recover(
        self,
        raw: Mapping[str, Any],
        sync: WeightSync,
        pods: list[PodView],
        seen: tuple[Mapping[str, AgentStatus], WeightSyncStatus],
        *,
        token: str,
        memory: Memory,
        sources: list[int],
    ) -> RecoveryPass:
        """Start and follow recoveries of pods that are behind; which to hold out."""
        statuses, old = seen
        lead = min(sources, default=0)  # plan rank 0: commits last, reports it
        source = next((p for p in pods if p.role is Role.SOURCE and p.rank == lead), None)
        recovering = await run_recoveries(
            raw=raw,
            spec=sync.spec,
            current=current_version(
                statuses.get(source.name) if source else None,
                Current(old.current_version, old.lineage),
            ),
            pods=pods,
            statuses=statuses,
            trackers=memory.recoveries,
            agents=self.agents,
            token=token,
            post_event=self.post_event,
            now=time.monotonic(),
            default_port=self.settings.agent_http_port,
        )
        memory.poll_soon = recovering.in_flight
        memory.watched = recovering.watched
        return recovering

    def _addresses(self, pods: list[PodView]) -> list[AgentAddress]:
        return [
            AgentAddress(p.name, p.ip, p.agent_port or self.settings.agent_http_port)
            for p in pods
            if p.has_agent and p.ip and p.running and not p.terminating
        ]

    async def _problem(
        self, raw: Mapping[str, Any], old: WeightSyncStatus, generation: int, problem: Problem
    ) -> None:
        reason, message = problem
        await self._write(raw, old, problem_status(old, generation, reason, message, utc_now()))

    def _send_plans(
        self,
        key: tuple[str, str],
        delivery: Coroutine[Any, Any, dict[str, str]],
        memory: Memory,
    ) -> asyncio.Task[dict[str, str]]:
        """A new generation's plans, sent in a task of their own (`Memory.sending`): a
        thousand agents, or one slow to answer, take seconds, and the pass need not wait
        for them all (`PLANS_WAIT_SECONDS`). One that ends later brings a pass."""
        started = time.monotonic()

        def ended(task: asyncio.Task[dict[str, str]]) -> None:
            if task.cancelled():  # the WeightSync is gone (`forget`)
                return
            error = task.exception()
            if error is not None:
                log_pass_failure(f"plans for {key[0]}/{key[1]}", error)
            if error is not None or time.monotonic() - started >= PLANS_WAIT_SECONDS:
                self.request(*key)

        task = asyncio.get_running_loop().create_task(delivery, name=f"plans {key[0]}/{key[1]}")
        task.add_done_callback(ended)
        memory.sending = task
        return task

    async def _write_observed(
        self,
        raw: Mapping[str, Any],
        old: WeightSyncStatus,
        observation: Observation,
        sending: asyncio.Task[dict[str, str]] | None,
    ) -> WeightSyncStatus:
        """Write the status `observation` makes; with a new generation's plans to send,
        while they go out (`sending`: the refusals by pod): a thousand plans take seconds,
        and `kubectl get wsync` need not wait to name the new members. Refusals (each
        refuser sits out, and the next pass plans without it) are written if every plan
        was answered within `PLANS_WAIT_SECONDS` of the write's start; later ones show in
        their Events and the generation planned next. The status last written."""
        new = observed_status(old, observation, utc_now())
        began = time.monotonic()
        written = await self._write(raw, old, new)
        if sending is None:
            return new
        # The plans went out with the write: they have its time too.
        await asyncio.wait(
            {sending}, timeout=max(0.0, began + PLANS_WAIT_SECONDS - time.monotonic())
        )
        if not sending.done() or sending.cancelled() or sending.exception() is not None:
            return new
        refusals = sending.result()
        if not refusals:
            return new
        refused = observed_status(new, replace(observation, plan_errors=refusals), utc_now())
        await self._write(written, new, refused)
        return refused

    async def _write(
        self, raw: Mapping[str, Any], old: WeightSyncStatus, new: WeightSyncStatus
    ) -> Mapping[str, Any]:
        """Write the status if it changed, then post Events for the transitions; the
        WeightSync as stored after (`raw` when nothing was written)."""
        body = new.to_k8s()
        if raw.get("status") == body:
            return raw  # what is stored already; `old` was parsed from it: no transitions
        meta = raw["metadata"]
        async with self.kube.writer.held():  # the status first (`apiwriter`)
            after = await self.kube.writer.patch_status(meta["namespace"], meta["name"], body)
        memory = self._memory.get((meta["namespace"], meta["name"]))
        if memory is not None:
            # A second write of a pass is made on its first (`cache.newest`).
            memory.seen_version = str(meta.get("resourceVersion"))
            memory.written = (memory.seen_version, after)
        for event in transition_events(old, new):
            self.post_event(raw, event)
        return after

    # -- deletion ----------------------------------------------------------------------

    async def release(self, namespace: str, raw: Mapping[str, Any]) -> None:
        """On deletion: open the readiness gates the WeightSync held, so no pod stays stuck."""
        await pod_actions.release(self.kube, namespace, raw, self.indexes)
        self.forget(namespace, raw["metadata"]["name"])
