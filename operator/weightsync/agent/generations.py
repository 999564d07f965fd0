"""The generations an agent holds: forming in the background, warm, active, retired.

`apply_plan` starts forming a generation and returns at once; the operator polls
`/v1/status` to see it warm. Rounds use one generation at a time; the source switches
to the newest warm one at a round boundary and tells the sinks through the old
generation's doorbell.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from weightsync.agent.failures import Stage
from weightsync.agent.group import Group, GroupSpec, form_group
from weightsync.agent.metrics import AgentMetrics
from weightsync.api.control import GenerationState, GenerationStatus, MembershipPlan
from weightsync.api.reasons import FailureReason
from weightsync.transfer.broadcast import TransferError

log = logging.getLogger(__name__)

_KEEP_RETIRED = 4  # retired generations kept for status, newest first


class PlanRejectedError(ValueError):
    """A plan that conflicts with what the agent already holds."""


@dataclass(eq=False)
class Generation:
    plan: MembershipPlan
    state: GenerationState = GenerationState.FORMING
    group: Group | None = None
    error: str | None = None
    task: asyncio.Task[None] | None = None
    next_seq: int = 0  # the next doorbell sequence number: `take_seq` moves it on
    layouts_sent: set[str] = field(default_factory=set)
    reports_sent: set[str] = field(default_factory=set)  # source ranks' report digests
    formed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def number(self) -> int:
        return self.plan.generation

    @property
    def usable(self) -> bool:
        return self.state in (GenerationState.WARM, GenerationState.ACTIVE)

    def status(self) -> GenerationStatus:
        prewarm = self.group.prewarm_seconds if self.group is not None else None
        return GenerationStatus(
            generation=self.number,
            state=self.state,
            rank=self.plan.rank,
            world_size=self.plan.world_size,
            prewarm_millis=None if prewarm is None else round(prewarm * 1000),
            error=self.error,
        )

    def take_seq(self) -> int:
        """The doorbell sequence number of the next round or switch notice: the source
        takes it to ring, a sink to listen (both move on in step)."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def mark_broken(self, reason: str) -> None:
        self.error = reason
        if self.state != GenerationState.RETIRED:
            self.state = GenerationState.BROKEN
        if self.group is not None:
            self.group.abort(reason)

    def retire(self) -> None:
        self.state = GenerationState.RETIRED
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.group is not None:
            self.group.close()


class Generations:
    def __init__(self, device: torch.device, metrics: AgentMetrics) -> None:
        self._device = device
        self._metrics = metrics
        self._by_number: dict[int, Generation] = {}
        self.changed = asyncio.Condition()

    def apply_plan(self, plan: MembershipPlan) -> Generation:
        """Start forming `plan`'s generation; idempotent for the same plan."""
        existing = self._by_number.get(plan.generation)
        if existing is not None:
            if existing.plan != plan:
                raise PlanRejectedError(
                    f"generation {plan.generation} already has a different plan"
                )
            return existing
        newest = max(self._by_number, default=0)
        if plan.generation < newest:
            raise PlanRejectedError(f"generation {plan.generation} is older than {newest}")
        generation = Generation(plan)
        self._by_number[plan.generation] = generation
        generation.task = asyncio.create_task(
            self._form(generation), name=f"form-g{plan.generation}"
        )
        self._prune()
        return generation

    async def _form(self, generation: Generation) -> None:
        plan = generation.plan
        spec = GroupSpec(
            sync_name=plan.sync_name,
            generation=plan.generation,
            rank=plan.rank,
            world_size=plan.world_size,
            backend=plan.backend,
            rendezvous_host=plan.rendezvous.host,
            rendezvous_port=plan.rendezvous.port,
            bind_host=plan.me.host,
            device=self._device,
            collective_timeout_seconds=plan.transfer.timeout_seconds,
            prewarm_timeout_seconds=plan.prewarm_timeout_seconds,
        )
        started = time.monotonic()
        try:
            group = await form_group(spec)
        except TransferError as exc:
            log.warning("generation %d failed to form: %s", plan.generation, exc)
            generation.error = f"{exc.reason}: {exc}"
            generation.state = GenerationState.BROKEN
            self._metrics.round_failures.labels(
                self._metrics.role, FailureReason.PREWARM_FAILED, Stage.PREPARE
            ).inc()
        else:
            generation.group = group
            if generation.state == GenerationState.FORMING:
                generation.state = GenerationState.WARM
                self._metrics.prewarm_duration.observe(time.monotonic() - started)
            else:  # retired while forming
                group.close()
        finally:
            generation.formed.set()
            async with self.changed:
                self.changed.notify_all()

    def _prune(self) -> None:
        retired = sorted(
            (n for n, g in self._by_number.items() if g.state == GenerationState.RETIRED),
            reverse=True,
        )
        for number in retired[_KEEP_RETIRED:]:
            del self._by_number[number]

    def get(self, number: int) -> Generation | None:
        return self._by_number.get(number)

    def all(self) -> list[Generation]:
        return [self._by_number[n] for n in sorted(self._by_number)]

    def newest_plan(self) -> MembershipPlan | None:
        if not self._by_number:
            return None
        return self._by_number[max(self._by_number)].plan

    def newest_usable(self) -> Generation | None:
        usable = [g for g in self.all() if g.usable]
        return usable[-1] if usable else None

    def oldest_listenable(self) -> Generation | None:
        """For sinks: the oldest generation that may still ring (usable or broken, formed)."""
        for generation in self.all():
            if generation.group is not None and generation.state != GenerationState.RETIRED:
                return generation
        return None

    def active(self) -> Generation | None:
        for generation in reversed(self.all()):
            if generation.state == GenerationState.ACTIVE:
                return generation
        return None

    def statuses(self) -> list[GenerationStatus]:
        return [g.status() for g in self.all()]

    async def close(self) -> None:
        for generation in self.all():
            generation.retire()
