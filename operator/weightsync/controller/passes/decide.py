"""The decide step of a pass: from what it observed and the soft state, what to do. Pure.

`decide` reads an `observe.Observed` and a `memory.SoftState`, changes neither, and
returns `actions.Actions`: the soft state after the pass, the status and its Events, the
plans of a new generation, the recoveries to start, the readiness gates to flip, and
when to pass again. It composes the pure modules: `recovery.decide_recoveries` (who
recovers, held out of the group meanwhile), `plan` and `generations.Planner` (members,
whether a new generation is due, the pre-warm timeout), `readiness` (the current version
and the gates), `status` and `transitions` (the status and its Events). Clocks come from
the observation, so a test constructs both inputs and checks the value.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from weightsync.api.protocol import out_of_skew
from weightsync.api.v1alpha1 import Role, SyncMode, WeightSync
from weightsync.controller.agents.view import AgentView
from weightsync.controller.cluster.pod_actions import uninjected
from weightsync.controller.membership.plan import (
    Desired,
    Slot,
    answering,
    desired_members,
    forming,
    intact,
    newcomers_wait,
)
from weightsync.controller.passes.actions import Actions, Outcome, Plans, Result, status_write
from weightsync.controller.passes.generations import Planned, Planner, Stored
from weightsync.controller.passes.memory import SoftState
from weightsync.controller.passes.observe import Observed
from weightsync.controller.readiness.gates import (
    Current,
    GateDecision,
    current_version,
    gate_changes,
    round_vouches,
    rounds_reach,
)
from weightsync.controller.recovery.decisions import Recoveries, decide_recoveries
from weightsync.controller.status.observed import Observation, observed_status, problem_status

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Group:
    """The group a pass decides on: the members wanted, the generation planned for them,
    the recoveries (pods behind are held out meanwhile), and whether the planned
    generation is past its pre-warm timeout."""

    desired: Desired
    planned: Planned
    recoveries: Recoveries
    prewarm_timed_out: bool
    skewed: dict[str, int]  # agents too many protocol versions away: neither planned nor recovered


def decide(seen: Observed, soft: SoftState) -> Actions:
    """What the pass does (see the module doc); `soft` is left as it was."""
    old = seen.old
    if seen.blocked is not None:
        blocked = seen.blocked
        new = problem_status(old, seen.generation, blocked.reason, blocked.message, seen.at)
        return Actions(
            Result(blocked.outcome, blocked.message),
            status_write(old, new),
            write_token=not seen.token_written,  # a valid spec waiting for its workloads
        )
    sync = seen.sync
    if sync is None:
        raise ValueError("an observation that is not blocked has its WeightSync")
    soft = soft.copy()
    group = _group(seen, sync, soft)
    planned = group.planned
    current, gates = _readiness(sync.spec.mode, planned.members, seen, soft)
    observation = Observation(
        spec=sync.spec,
        metadata_generation=seen.generation,
        pods=seen.pods,
        statuses=seen.agents.statuses,
        desired=group.desired,
        planned=planned.members,
        planned_generation=planned.generation,
        current=current,
        prewarm_timed_out=group.prewarm_timed_out,
        agent_errors=seen.agents.errors,
        sources=seen.sources,
        skewed=group.skewed,
    )
    plans = None
    if planned.fresh and planned.generation is not None:
        plans = Plans(planned.generation, group.desired)
    held = group.recoveries.held
    kind = sync.spec.trainer.kind
    recreate, young = uninjected(seen.raw, seen.pods, seen.webhook_settling, kind, seen.at)
    return Actions(
        Result(Outcome.OK),
        status_write(old, observed_status(old, observation, seen.at), observation),
        soft=soft,
        recoveries=group.recoveries,
        plans=plans,
        gates=tuple(gates),
        write_token=not seen.token_written,
        recreate=tuple(recreate),
        poll_soon=held.in_flight or young,  # a young pod to recreate: no event may come
        watched=held.watched,
    )


def _group(seen: Observed, sync: WeightSync, soft: SoftState) -> Group:
    """Recoveries, then the members wanted, the generation planned (a new one if the
    group must change: its plans not sent yet), and whether it is past its pre-warm
    timeout. Changes `soft`, the pass's own copy."""
    spec, view, old, pods, now = sync.spec, seen.agents, seen.old, seen.pods, seen.now
    statuses = view.statuses
    soft.cooldown = {uid: t for uid, t in soft.cooldown.items() if t > now}
    cooling = {p.name for p in pods if p.uid in soft.cooldown}
    skewed = out_of_skew({pod: s.protocol_version for pod, s in statuses.items()})
    recoveries = _recoveries(seen, sync, soft, skewed)
    soft.recoveries = recoveries.trackers
    excluded = cooling | recoveries.held.held_out | skewed.keys()
    generation, previous = soft.planned(
        old.group_generation, [Slot(m.rank, m.pod, m.role) for m in old.members]
    )
    # Answers to requests sent since the planned generation was delivered: the only
    # evidence about it (all of them after a restart: it was delivered before).
    evidence = view.since(soft.planned_at.get(generation or 0))
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
        spec, pods, answering(pods, statuses), previous, sources=seen.sources,
        excluded=excluded, previous_engine=planned_engine, unknown=unknown,
    )  # fmt: skip
    # Newcomers, since when: they may wait a while for more pods (`newcomers_wait`).
    names = {slot.pod for slot in previous}
    if all(m.name in names for m in desired.members):
        soft.newcomers_since = None
    elif soft.newcomers_since is None:
        soft.newcomers_since = now
    batching = soft.newcomers_since is not None and newcomers_wait(
        pods, desired, previous, cooling=cooling,
        waiting_for=now - soft.newcomers_since, replicas=seen.replicas,
    )  # fmt: skip
    planned = Planner.plan(
        seen.raw, Stored(old, previous, planned_engine), desired, statuses,
        evidence=evidence, memory=soft, generation=generation, batching=batching,
        plans_in_flight=seen.plans_in_flight, now=now,
    )  # fmt: skip
    if planned.generation != generation:  # a new generation took the newcomers in
        soft.newcomers_since = None
    elif soft.newcomers_since is not None and log.isEnabledFor(logging.DEBUG):
        log.debug(
            "%s: %d newcomers wait %.1f s (more pods on their way: %s; generation %s"
            " still forming: %s)", seen.raw["metadata"]["name"],
            sum(1 for m in desired.members if m.name not in names),
            now - soft.newcomers_since, batching, generation,
            generation is not None and forming(previous, generation, evidence),
        )  # fmt: skip
    evidence = view.since(soft.planned_at.get(planned.generation or 0))
    timed_out = Planner.prewarm_timed_out(sync, planned, evidence, pods, soft, now=now)
    return Group(desired, planned, recoveries, timed_out, skewed)


def _recoveries(
    seen: Observed, sync: WeightSync, soft: SoftState, skewed: Mapping[str, int]
) -> Recoveries:
    """Recoveries of pods that are behind, to start and follow; which to hold out. An
    agent out of skew is asked nothing: its pod shows as if its agent were silent."""
    old = seen.old
    statuses = {p: s for p, s in seen.agents.statuses.items() if p not in skewed}
    lead = min(seen.sources, default=0)  # plan rank 0: commits last, reports it
    source = next((p for p in seen.pods if p.role is Role.SOURCE and p.rank == lead), None)
    return decide_recoveries(
        spec=sync.spec,
        current=current_version(
            statuses.get(source.name) if source else None,
            Current(old.current_version, old.lineage),
        ),
        pods=seen.pods,
        statuses=statuses,
        trackers=soft.recoveries,
        now=seen.now,
        default_port=seen.agent_port,
    )


def _readiness(
    mode: SyncMode, planned: list[Slot], seen: Observed, soft: SoftState
) -> tuple[Current, list[GateDecision]]:
    """The current version (the planned source's word) and the gates to change."""
    view: AgentView = seen.agents
    statuses, old = view.statuses, seen.old
    source_pod = next((s.pod for s in planned if s.role is Role.SOURCE), None)
    source = statuses.get(source_pod) if source_pod is not None else None
    current = current_version(source, Current(old.current_version, old.lineage))
    # Colocated engines are no members: the source loads them whatever the generation.
    reached, vouched = None, frozenset[str]()
    if mode is not SyncMode.COLOCATED:
        reached = rounds_reach(source, statuses, soft.unheard(view))
        since = view.first_said(source_pod, source) if source_pod and source else None
        vouched = round_vouches(source, current, statuses, view.heard_at, since)
    gates = gate_changes(
        seen.pods, statuses, view.errors, current, reached=reached, vouched=vouched,
        source_unheard=source_pod is not None and source is None,
    )  # fmt: skip
    return current, gates
