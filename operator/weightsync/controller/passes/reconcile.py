"""One level-based reconcile pass over a WeightSync, and when passes run around it.

A pass is three steps: `observe` reads what it acts on into one immutable `Observed`
(the WeightSync, its workloads' pods, the agents' answers); `decide.decide`, pure, turns
that and the soft state (`memory.SoftState`) into `actions.Actions`; `apply` performs
them (recoveries, plans, the status and its Events, readiness gates, the token
Secret, recreated pods). This module runs passes one at a time per WeightSync (`scheduling`),
follows recoveries up (a pass soon while one is in flight), and owns the timers' polls:
the drift timer's sweep of every agent (`resync`) and the trainer's agents asked every
second (`watch_sources`).

Soft state only (`memory`): the agents' answers (a restart polls them again), when a
generation was planned (a restart restarts the pre-warm clock), cooldowns, recovery
trackers (a restart may report a finished recovery once more), gate writes in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from weightsync.api.control import AgentStatus
from weightsync.controller import metrics
from weightsync.controller.agents.client import AgentClient
from weightsync.controller.cluster import pod_actions
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.cluster.events import PostEvent
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.passes.actions import Outcome, Result
from weightsync.controller.passes.apply import Applier
from weightsync.controller.passes.decide import decide
from weightsync.controller.passes.generations import Planner
from weightsync.controller.passes.memory import Laps, Memory
from weightsync.controller.passes.observe import Key, Observer
from weightsync.controller.passes.scheduling import PassScheduler, log_pass_failure
from weightsync.controller.runtime.tasks import Tasks
from weightsync.controller.settings import OperatorSettings

__all__ = ["Outcome", "Reconciler", "Result", "log_pass_failure"]

log = logging.getLogger(__name__)

SLOW_PASS_SECONDS = 2.0  # a pass this long logs where its time went

RECOVERY_POLL_SECONDS = 1.0  # how soon a pass follows one that left a recovery running
EVENT_PASS_DELAY_SECONDS = 0.5  # a pod event's pass waits this long for the rest of a burst
SOURCE_POLL_SECONDS = 1.0  # how often the trainer's agents are asked (`watch_sources`)


def _round_word(status: AgentStatus | None) -> tuple[object, ...] | None:
    """What a source says about rounds: its version and its last round's report."""
    return None if status is None else (status.version, status.lineage, status.last_round)


class Reconciler:
    """Runs passes, one at a time per WeightSync (`scheduling`), and follows recoveries up."""

    def __init__(
        self,
        kube: Kube,
        agents: AgentClient,
        settings: OperatorSettings,
        post_event: PostEvent,
        token_key: bytes,
        *,
        indexes: Indexes | None = None,
        tasks: Tasks | None = None,
    ) -> None:
        self.kube = kube
        self.tasks = tasks = tasks or Tasks()
        self.indexes = indexes or Indexes()
        self.agents = agents
        self.settings = settings
        self.post_event = post_event
        self._memory: dict[Key, Memory] = {}
        self.planner = Planner(agents, settings, post_event)
        request = self._request_now
        self.observer = Observer(
            kube, self.indexes, agents, settings, token_key, request=request, tasks=tasks
        )
        self.applier = Applier(kube, agents, self.planner, post_event, request, tasks=tasks)
        self._scheduler: PassScheduler[Key, Result] = PassScheduler(
            self._measured, request_delay=EVENT_PASS_DELAY_SECONDS, tasks=tasks
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
            memory.poll = self.tasks.spawn(
                f"poll {namespace}/{name}", self._poll(namespace, name, memory)
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

    def _request_now(self, namespace: str, name: str) -> None:
        """`request` as it is at the call (a test may replace it after construction)."""
        self.request(namespace, name)

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

    async def _measured(self, key: Key) -> Result:
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

    async def _pass(self, namespace: str, name: str, memory: Memory) -> Result:
        """Observe, decide, apply."""
        seen = await self.observer.observe((namespace, name), memory)
        if seen is None:
            return Result(Outcome.GONE)
        actions = decide(seen, memory)
        memory.laps("decide")
        await self.applier.apply(seen, actions, memory)  # adopts `actions.soft` first
        return actions.result

    # -- deletion ----------------------------------------------------------------------

    async def release(self, namespace: str, raw: Mapping[str, Any]) -> None:
        """On deletion: open the readiness gates the WeightSync held, so no pod stays stuck."""
        await pod_actions.release(self.kube, namespace, raw, self.indexes)
        self.forget(namespace, raw["metadata"]["name"])
