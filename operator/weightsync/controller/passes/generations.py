"""Group generations: when the operator plans a new one, delivering its plans, and the
pre-warm timeout that benches members that never warmed."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.api import ConditionType, find_condition, reasons
from weightsync.api.control import AgentStatus
from weightsync.api.v1alpha1 import Role, WeightSync, WeightSyncStatus
from weightsync.controller import metrics
from weightsync.controller.agents.client import AgentAddress, AgentClient
from weightsync.controller.cluster.events import PostEvent
from weightsync.controller.membership.plan import (
    Desired,
    Slot,
    build_plans,
    cold_members,
    needs_new_generation,
    next_generation,
    slots,
    warm_at,
)
from weightsync.controller.membership.workloads import PodView
from weightsync.controller.passes.memory import Memory, SoftState, Unsaved
from weightsync.controller.settings import OperatorSettings
from weightsync.controller.status.observed import EventSpec

log = logging.getLogger(__name__)

PLAN_FAILURE_COOLDOWN_SECONDS = 10.0  # a pod that refused a plan sits out this long


@dataclass(frozen=True, slots=True)
class Stored:
    """The planned generation as a pass finds it: the status as read, the members of the
    planned generation, and the Colocated engine that generation feeds."""

    status: WeightSyncStatus
    members: list[Slot]
    engine: str | None = None


@dataclass(frozen=True, slots=True)
class Planned:
    """The generation a pass plans for: its members, its number (None: none yet), and
    whether it is new this pass (its plans are then the caller's to send, `deliver`)."""

    members: list[Slot]
    generation: int | None
    fresh: bool = False


class Planner:
    """Plans generations without I/O (on a pass's copy of the soft state) and delivers
    their plans."""

    def __init__(
        self, agents: AgentClient, settings: OperatorSettings, post_event: PostEvent
    ) -> None:
        self.agents = agents
        self.settings = settings
        self.post_event = post_event

    @classmethod
    def plan(
        cls,
        raw: Mapping[str, Any],
        stored: Stored,
        desired: Desired,
        statuses: Mapping[str, AgentStatus],
        *,
        evidence: Mapping[str, AgentStatus],
        memory: SoftState,
        generation: int | None,
        plans_in_flight: bool,
        now: float,
        batching: bool = False,
    ) -> Planned:
        """Plan a new generation if the group must change. `stored`: what the status
        says of the planned generation; `generation`: the planned one (the status's, or
        newer, `SoftState.planned`). `statuses`: every agent's latest answer; `evidence`:
        those given since the planned generation was delivered, the only ones that can
        show it broken (`plan.needs_new_generation`); `batching`: newcomers wait for more
        pods on their way (`plan.newcomers_wait`). While the planned generation's plans
        still go out (`plans_in_flight`) it is kept: members not reached yet report no
        such generation, which is no evidence that it broke. `now`: monotonic."""
        planned = stored.members
        if plans_in_flight:
            return Planned(planned, generation)
        # Prewarmed is written only by passes that planned (or kept) a group, so its
        # observedGeneration is the spec generation the current group was planned from.
        prewarmed = find_condition(stored.status.conditions, ConditionType.PREWARMED)
        planned_from = prewarmed.observed_generation if prewarmed is not None else None
        unsaved = memory.unsaved
        if unsaved is not None and unsaved.generation == generation:
            planned_from = unsaved.spec_generation  # the status has not caught up yet
        spec_generation = int(raw["metadata"].get("generation") or 0)
        older_spec = planned_from is not None and planned_from != spec_generation
        if not needs_new_generation(
            desired,
            planned,
            generation,
            evidence,
            planned_from_older_spec=older_spec,
            planned_engine=stored.engine,
            abandoned=memory.abandoned is not None and memory.abandoned == generation,
            batching=batching,
        ):
            return Planned(planned, generation)
        number = next_generation(generation, statuses)
        members = list(slots(desired.members))
        # Its plans go out from now (`deliver`): what a pass decides meanwhile counts it
        # delivered (`readiness.rounds_reach`) and its pre-warm clock running.
        cls.sent(memory, number, members, now)
        memory.unsaved = Unsaved(number, members, spec_generation)
        return Planned(members, number, fresh=True)

    @staticmethod
    def sent(memory: SoftState, number: int, members: list[Slot], now: float) -> None:
        """Generation `number`'s plans went out at `now`: its clocks start there."""
        memory.planned_at = {number: now}  # older ones no longer matter
        memory.delivered(number, members, now)

    async def deliver(
        self,
        raw: Mapping[str, Any],
        sync: WeightSync,
        *,
        generation: int,
        desired: Desired,
        token: str,
        memory: Memory,
    ) -> dict[str, str]:
        """Send the plans of the new `generation` (`plan`) to its members: the refusals
        by pod (those sit out a while), the clocks restarted once every plan was sent."""
        meta = raw["metadata"]
        members = desired.members
        plans = build_plans(
            sync_name=f"{meta['namespace']}/{meta['name']}",
            spec=sync.spec,
            generation=generation,
            members=members,
            rendezvous_port=self.settings.rendezvous_port,
            engine=desired.engine,
        )
        deliveries = {
            pod.name: (
                AgentAddress(
                    pod.name, pod.ip or "", pod.agent_port or self.settings.agent_http_port
                ),
                plan,
            )
            for pod, plan in zip(members, plans, strict=True)
        }
        statuses = memory.agents.statuses
        versions = {pod: status.protocol_version for pod, status in statuses.items()}
        errors = await self.agents.deliver(deliveries, token, versions)
        metrics.GENERATIONS_PLANNED.inc()
        log.info(
            "%s/%s: planned generation %d with %d ranks (%d refused)",
            meta["namespace"], meta["name"], generation, len(members), len(errors),
        )  # fmt: skip
        self.post_event(
            raw,
            EventSpec(
                "Normal",
                reasons.GENERATION_PLANNED,
                reasons.GENERATION_PLANNED_MESSAGE.format(
                    generation=generation,
                    count=len(members),
                    pods=reasons.listing([p.name for p in members]),
                ),
            ),
        )
        deadline = time.monotonic() + PLAN_FAILURE_COOLDOWN_SECONDS
        for pod in members:
            if pod.name in errors:
                if pod.role is not Role.SOURCE:  # the only source never sits out
                    memory.cooldown[pod.uid] = deadline
                self.post_event(
                    raw,
                    EventSpec(
                        "Warning",
                        reasons.PLAN_REJECTED,
                        reasons.PLAN_REJECTED_MESSAGE.format(
                            pod=pod.name, generation=generation, error=errors[pod.name]
                        ),
                    ),
                )
        self.sent(memory, generation, list(slots(members)), time.monotonic())
        return errors

    @staticmethod
    def prewarm_timed_out(
        sync: WeightSync,
        group: Planned,
        evidence: Mapping[str, AgentStatus],
        pods: list[PodView],
        memory: SoftState,
        *,
        now: float,
    ) -> bool:
        """Whether the planned generation is past its pre-warm timeout; cold pods cool down.
        Only members that answered since it was delivered (`evidence`) and report it
        not warm are cold: one whose answers the operator lacks is unknown, and the
        operator being slow never benches anyone. `now`: monotonic."""
        planned, generation = group.members, group.generation
        if generation is None or not planned or not sync.spec.prewarm.enabled:
            return False
        if all(warm_at(evidence.get(slot.pod), generation, slot.rank) for slot in planned):
            memory.formed = generation
        if memory.formed == generation:
            # It pre-warmed: a member that breaks it later (its trainer pod replaced, a
            # peer lost) is evidence for a new generation (`needs_new_generation`), not a
            # pre-warm timeout; benching the survivors then only delayed that one.
            return False
        since = memory.planned_at.setdefault(generation, now)
        if now - since < sync.spec.prewarm.timeout_seconds:
            return False
        cold = cold_members(planned, generation, evidence)
        if not cold or memory.abandoned == generation:
            return bool(cold)
        # Once per generation: cooling its cold members down again on every pass kept
        # them out for good when all sinks were cold (no group formable, so no new
        # generation, so the same timeout again): the operator stopped planning at all.
        memory.abandoned = generation
        uids = {p.name: p.uid for p in pods}
        for slot in cold:
            # The source never cools down: without it no generation could be planned at
            # all, and the trainer would wait on a group that never forms.
            if slot.pod in uids and slot.role is not Role.SOURCE:
                memory.cooldown[uids[slot.pod]] = now + sync.spec.prewarm.timeout_seconds
        return True
