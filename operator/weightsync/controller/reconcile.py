"""One level-based reconcile pass over a WeightSync, and the per-object bookkeeping around it.

A pass reads everything it acts on from the API server and the agents (nothing it
decides depends on an earlier pass having run in this process):

1. the WeightSync (spec, stored status) and the other WeightSyncs of its namespace;
2. the trainer StatefulSet, the inference Deployments, their ReplicaSets and pods;
3. the agents' `GET /v1/status` (token from the WeightSync's Secret, created if absent);

then decides with the pure modules (`plan`, `readiness`, `recovery`, `status`) and acts:
starts P2P recoveries of pods that are behind (`POST /v1/recover`, holding them out of
the group until they are done), delivers a new generation with `PUT /v1/plan` if
membership changed, sets each inference pod's readiness gate, writes the status once and
posts Events for what changed.

The only in-memory state is soft: when a generation was planned (for the pre-warm
timeout; a restarted operator starts that clock again), which pods sit out a cooldown
after a failed delivery or a pre-warm timeout, and each recovering pod's failures and
reported attempts (a restart may report a finished recovery once more).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from weightsync.api import parse_weightsync, reasons
from weightsync.api.base import utc_now
from weightsync.api.control import AgentStatus
from weightsync.api.v1alpha1 import Role, SyncMode, WeightSync, WeightSyncStatus
from weightsync.api.validation import WeightSyncInvalidError
from weightsync.controller import metrics, tokens
from weightsync.controller import pods as pod_actions
from weightsync.controller.agents import AgentAddress, AgentClient
from weightsync.controller.generations import Planner
from weightsync.controller.kube import Kube, api_unavailable
from weightsync.controller.memory import Memory
from weightsync.controller.plan import (
    Slot,
    desired_members,
)
from weightsync.controller.pods import EventPoster
from weightsync.controller.readiness import Current, current_version, rounds_reach
from weightsync.controller.recoveries import RecoveryPass, run_recoveries
from weightsync.controller.scheduling import PassScheduler
from weightsync.controller.settings import OperatorSettings
from weightsync.controller.status import (
    Observation,
    observed_status,
    problem_status,
    transition_events,
)
from weightsync.controller.workloads import (
    PodView,
    claim_conflicts,
    planned_sources,
    sync_pods,
)

log = logging.getLogger(__name__)

RECOVERY_POLL_SECONDS = 1.0  # how soon a pass follows one that left a recovery running

Problem = tuple[str, str]  # (reason, message) for Ready=False


class Outcome(StrEnum):
    OK = "ok"
    WAITING = "waiting"  # a referenced workload is missing: retry slowly
    INVALID = "invalid"  # the spec is wrong: nothing to do until it changes
    GONE = "gone"  # deleted, or being deleted


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    message: str = ""


def log_pass_failure(what: str, error: Exception) -> None:
    """A pass that failed outside kopf's retries (a timer, a follow-up): one line when the
    API server is away (the next pass retries), the traceback for anything else."""
    if api_unavailable(error):
        log.warning("%s: the API server is unavailable (%s); the next pass retries", what, error)
    else:
        log.error("%s failed", what, exc_info=error)


def stored_status(raw: Mapping[str, Any]) -> WeightSyncStatus:
    """The stored status, or an empty one if it does not parse (then it is rewritten whole)."""
    try:
        return WeightSyncStatus.model_validate(raw.get("status") or {})
    except ValidationError:
        log.warning("status of %s does not parse; rebuilding it", raw["metadata"]["name"])
        return WeightSyncStatus()


def _created(raw: Mapping[str, Any]) -> tuple[str, str]:
    meta = raw["metadata"]
    return (str(meta.get("creationTimestamp") or ""), str(meta.get("name") or ""))


class Reconciler:
    """Runs passes, one at a time per WeightSync (`scheduling`), and follows recoveries up."""

    def __init__(
        self,
        kube: Kube,
        agents: AgentClient,
        settings: OperatorSettings,
        post_event: EventPoster,
        token_key: bytes,
    ) -> None:
        self.kube = kube
        self.agents = agents
        self.settings = settings
        self.token_key = token_key
        self.post_event = post_event
        self._memory: dict[tuple[str, str], Memory] = {}
        self.planner = Planner(agents, settings, post_event)
        self._scheduler: PassScheduler[tuple[str, str], Result] = PassScheduler(self._measured)
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
            await self.run(namespace, name)
        except Exception as error:
            log_pass_failure(f"follow-up pass of {namespace}/{name}", error)

    async def run(self, namespace: str, name: str) -> Result:
        """The result of a pass that started after this call (see `scheduling`)."""
        return await self._scheduler.run((namespace, name))

    async def _measured(self, key: tuple[str, str]) -> Result:
        namespace, name = key
        memory = self._memory.setdefault(key, Memory())
        memory.poll_soon = False
        started = time.perf_counter()
        try:
            result = await self._pass(namespace, name, memory)
        except Exception:
            metrics.RECONCILES.labels("error").inc()
            raise
        finally:
            metrics.RECONCILE_DURATION.observe(time.perf_counter() - started)
        metrics.RECONCILES.labels(result.outcome.value).inc()
        if result.outcome is Outcome.GONE:
            self._memory.pop(key, None)  # a pod event named it late
        elif memory.poll_soon:
            self._poll_later(namespace, name, memory)
        return result

    # -- the pass --------------------------------------------------------------------

    async def _pass(self, namespace: str, name: str, memory: Memory) -> Result:
        raw = await asyncio.to_thread(self.kube.get_weightsync, namespace, name)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return Result(Outcome.GONE)
        generation = int(raw["metadata"].get("generation") or 0)
        old = stored_status(raw)
        try:
            sync = parse_weightsync(raw)
        except WeightSyncInvalidError as error:
            message = reasons.INVALID_SPEC_MESSAGE.format(errors=error)
            await self._problem(raw, old, generation, (reasons.INVALID_SPEC, message))
            return Result(Outcome.INVALID, message)
        problem = await self._spec_problem(namespace, raw, sync)
        if problem is not None:
            await self._problem(raw, old, generation, problem)
            return Result(Outcome.INVALID, problem[1])
        spec = sync.spec
        trainer = spec.trainer.stateful_set_ref.name
        deployments = [entry.deployment_ref.name for entry in spec.inference]
        world = await asyncio.to_thread(self.kube.observe, namespace, trainer, deployments)
        missing = self._missing(world.statefulset, world.deployments, trainer)
        if missing is not None:
            await self._problem(raw, old, generation, missing)
            return Result(Outcome.WAITING, missing[1])
        token = tokens.derive(self.token_key, namespace, sync.metadata.name or "")
        uid = raw["metadata"]["uid"]
        if memory.token_written_for != uid:  # once per WeightSync object (and per restart)
            await asyncio.to_thread(self.kube.apply_token, namespace, raw, token)
            memory.token_written_for = uid
        pods = sync_pods(sync, world)
        await pod_actions.recreate_uninjected(
            self.kube, self.post_event, raw, pods, self.webhook_settling
        )
        statuses, errors = await self.agents.statuses(self._addresses(pods), token)

        now = time.monotonic()
        memory.cooldown = {uid: t for uid, t in memory.cooldown.items() if t > now}
        excluded = {p.name for p in pods if p.uid in memory.cooldown}
        sources = planned_sources(sync, world, pods)
        recovering = await self._recover(
            raw, sync, pods, (statuses, old), token=token, memory=memory, sources=sources
        )
        excluded |= recovering.held_out
        previous = [Slot(m.rank, m.pod, m.role) for m in old.members]
        # Colocated: the engine pod the planned group feeds, as its source agent says.
        planned_source = next((s.pod for s in previous if s.role is Role.SOURCE), None)
        source_status = statuses.get(planned_source) if planned_source else None
        planned_engine = source_status.local_engine if source_status else None
        desired = desired_members(
            spec,
            pods,
            statuses.keys(),
            previous,
            sources=sources,
            excluded=excluded,
            previous_engine=planned_engine,
        )
        planned, planned_generation, plan_errors = await self.planner.plan(
            raw,
            sync,
            (old, previous, planned_engine),
            desired,
            statuses,
            token=token,
            memory=memory,
        )
        timed_out = self.planner.prewarm_timed_out(
            sync, (planned, planned_generation), statuses, pods, memory
        )

        source = next((statuses.get(s.pod) for s in planned if s.role is Role.SOURCE), None)
        current = current_version(source, Current(old.current_version, old.lineage))
        # Colocated engines are no members: the source loads them whatever the generation.
        reached = None if spec.mode is SyncMode.COLOCATED else rounds_reach(source, statuses)
        await pod_actions.set_gates(
            self.kube, namespace, pods, statuses=statuses, errors=errors, current=current,
            reached=reached,
        )  # fmt: skip
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
            plan_errors=plan_errors,
            agent_errors=errors,
            sources=sources,
        )
        new = observed_status(old, observation, utc_now())
        await self._write(raw, old, new)
        metrics.record_status(namespace, name, new)
        return Result(Outcome.OK)

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
        return recovering

    async def _spec_problem(
        self, namespace: str, raw: Mapping[str, Any], sync: WeightSync
    ) -> Problem | None:
        """What the CRD cannot check: claims by older WeightSyncs."""
        listing = await asyncio.to_thread(self.kube.list_weightsyncs, namespace)
        older = []
        for other in listing:
            if _created(other) >= _created(raw):
                continue
            try:
                older.append(parse_weightsync(other))
            except WeightSyncInvalidError:
                continue  # an invalid WeightSync syncs nothing, so it claims nothing
        conflicts = claim_conflicts(sync, older)
        if conflicts:
            message = reasons.WORKLOAD_CLAIMED_MESSAGE.format(conflicts="; ".join(conflicts))
            return reasons.WORKLOAD_CLAIMED, message
        return None

    @staticmethod
    def _missing(
        statefulset: Mapping[str, Any] | None,
        deployments: Mapping[str, Mapping[str, Any] | None],
        trainer: str,
    ) -> Problem | None:
        if statefulset is None:
            return (
                reasons.TRAINER_NOT_FOUND,
                reasons.TRAINER_NOT_FOUND_MESSAGE.format(name=trainer),
            )
        for name, deployment in deployments.items():
            if deployment is None:
                return (
                    reasons.DEPLOYMENT_NOT_FOUND,
                    reasons.DEPLOYMENT_NOT_FOUND_MESSAGE.format(name=name),
                )
        return None

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

    async def _write(
        self, raw: Mapping[str, Any], old: WeightSyncStatus, new: WeightSyncStatus
    ) -> None:
        """Write the status if it changed, then post Events for the transitions."""
        if new == old and raw.get("status") == new.to_k8s():
            return
        meta = raw["metadata"]
        await asyncio.to_thread(
            self.kube.patch_status, meta["namespace"], meta["name"], new.to_k8s()
        )
        for event in transition_events(old, new):
            self.post_event(raw, event)

    # -- deletion ----------------------------------------------------------------------

    async def release(self, namespace: str, raw: Mapping[str, Any]) -> None:
        """On deletion: open the readiness gates the WeightSync held, so no pod stays stuck."""
        await pod_actions.release(self.kube, namespace, raw)
        self.forget(namespace, raw["metadata"]["name"])
