"""The apply step of a pass: performs the `actions.Actions` that `decide` returned.

In order: the soft state is adopted (before any await, so nothing the background does
meanwhile is lost), the token Secret written (once per WeightSync object: its pods cannot
start without it; a failure is logged, the next pass writes it), recoveries reported and
started, then the status written while a
new generation's plans go out (`PLANS_WAIT_SECONDS`: a thousand plans take seconds, and
`kubectl get wsync` need not wait to name the new members; refusals answered in time are
written once more), Events posted, the readiness gates handed to a background writer
(`gatesync`: status first, so `kubectl get wsync` never lags them), and last the pods
the webhook missed, recreated (a pod without the sidecar has no agent).

Recoveries (`carry_out`): attempts that ended are counted and reported in Events, then
the requests `recovery.decide_recoveries` chose are posted together (`POST /v1/recover`;
a refusal counts as a failed attempt in the pod's tracker).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any

from kubernetes.client.exceptions import ApiException

from weightsync.api import reasons
from weightsync.api.base import utc_now
from weightsync.api.control import RecoverRequest, RecoveryState, RecoveryStatus
from weightsync.api.v1alpha1 import WeightSyncStatus
from weightsync.controller import metrics
from weightsync.controller.agents.client import AgentAddress, AgentClient
from weightsync.controller.cluster import pod_actions
from weightsync.controller.cluster.events import PostEvent
from weightsync.controller.cluster.gatesync import GateSync
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.membership.plan import slots
from weightsync.controller.passes.actions import Actions, Outcome, StatusWrite, status_write
from weightsync.controller.passes.generations import Planner
from weightsync.controller.passes.memory import Memory
from weightsync.controller.passes.observe import Key, Observed
from weightsync.controller.passes.scheduling import log_pass_failure
from weightsync.controller.recovery.decisions import (
    Decision,
    Recoveries,
    RecoveryStart,
    Tracker,
    backoff_seconds,
    start_refused,
)
from weightsync.controller.runtime.tasks import Tasks
from weightsync.controller.status.observed import EventSpec, observed_status

# How long a pass that planned a new generation waits for its plans to be answered; the
# rest go on, and their end brings a pass (refusals sit out, a new generation follows).
PLANS_WAIT_SECONDS = 1.0


class Applier:
    """Performs a pass's actions; `request` asks for a pass (plans answered late)."""

    def __init__(
        self,
        kube: Kube,
        agents: AgentClient,
        planner: Planner,
        post_event: PostEvent,
        request: Callable[[str, str], None],
        *,
        tasks: Tasks | None = None,
    ) -> None:
        self.kube, self.agents, self.planner = kube, agents, planner
        self.post_event, self.request = post_event, request
        self.tasks = tasks or Tasks()

    async def apply(self, seen: Observed, actions: Actions, memory: Memory) -> None:
        raw, laps = seen.raw, memory.laps
        namespace, name = raw["metadata"]["namespace"], raw["metadata"]["name"]
        if actions.status is not None and actions.result.outcome is not Outcome.OK:
            if actions.write_token:  # waiting for a workload whose pods need it
                await self.write_token(raw, seen.token, memory)
            await self.write(raw, actions.status, memory)  # a problem: Ready=False
            return
        if actions.soft is not None:
            memory.adopt(actions.soft)
            memory.watched = actions.watched
        memory.poll_soon = actions.poll_soon
        if actions.write_token:
            await self.write_token(raw, seen.token, memory)
        if actions.recoveries is not None:
            await carry_out(
                actions.recoveries, raw=raw, agents=self.agents, token=seen.token,
                post_event=self.post_event, now=seen.now, default_port=seen.agent_port,
            )  # fmt: skip
            laps("recover")
        sending = None
        if actions.plans is not None and seen.sync is not None:
            plans = actions.plans
            # The clocks start as the plans go out, after the requests above.
            members = list(slots(plans.desired.members))
            Planner.sent(memory, plans.generation, members, time.monotonic())
            delivery = self.planner.deliver(
                raw, seen.sync, generation=plans.generation, desired=plans.desired,
                token=seen.token, memory=memory,
            )  # fmt: skip
            sending = self.send_plans((namespace, name), delivery, memory)
        if actions.status is None:
            return
        new = await self.write_status(raw, actions.status, sending, memory)
        laps("status" if sending is None else "status, plans")
        if memory.gates is None:
            memory.gates = GateSync(self.kube.writer, namespace, self.tasks)
        memory.gates.submit(seen.pods, actions.gates)
        metrics.record_status(namespace, name, new)
        # Last: nothing above waits on them.
        if actions.recreate:
            await pod_actions.recreate(self.kube, self.post_event, raw, actions.recreate)

    async def write_token(self, raw: Mapping[str, Any], token: str, memory: Memory) -> None:
        """The agents' token Secret, early in the pass: the WeightSync's pods are being
        created meanwhile, and the kubelet cannot start one before its token Secret exists
        (FailedMount, retried with back-off). A failed write does not fail the pass (its
        plans must still go out: the soft state counts them delivered); the next pass
        writes it."""
        namespace, name = raw["metadata"]["namespace"], raw["metadata"]["name"]
        try:
            await self.kube.write_token(namespace, raw, token)
        except (ApiException, ConnectionError) as error:
            log_pass_failure(f"the agent token Secret of {namespace}/{name}", error)
            return
        memory.token_written_for = raw["metadata"]["uid"]

    def send_plans(
        self, key: Key, delivery: Coroutine[Any, Any, dict[str, str]], memory: Memory
    ) -> asyncio.Task[dict[str, str]]:
        """A new generation's plans, sent in a task of their own (`Memory.sending`): a
        thousand agents, or one slow to answer, take seconds, and the pass need not wait
        for them all (`PLANS_WAIT_SECONDS`). One that ends later brings a pass."""
        started = time.monotonic()

        def ended(task: asyncio.Task[dict[str, str]]) -> None:
            if task.cancelled():  # the WeightSync is gone (`Reconciler.forget`)
                return
            error = task.exception()
            if error is not None:
                log_pass_failure(f"plans for {key[0]}/{key[1]}", error)
            if error is not None or time.monotonic() - started >= PLANS_WAIT_SECONDS:
                self.request(*key)

        task = self.tasks.spawn(f"plans {key[0]}/{key[1]}", delivery)
        task.add_done_callback(ended)
        memory.sending = task
        return task

    async def write_status(
        self,
        raw: Mapping[str, Any],
        write: StatusWrite,
        sending: asyncio.Task[dict[str, str]] | None,
        memory: Memory,
    ) -> WeightSyncStatus:
        """Write `write`'s status; with a new generation's plans to send, while they go
        out (`sending`: the refusals by pod). Refusals (each refuser sits out, and the
        next pass plans without it) are written if every plan was answered within
        `PLANS_WAIT_SECONDS` of the write's start; later ones show in their Events and the
        generation planned next. The status last written."""
        began = time.monotonic()
        written = await self.write(raw, write, memory)
        if sending is None:
            return write.new
        # The plans went out with the write: they have its time too.
        await asyncio.wait(
            {sending}, timeout=max(0.0, began + PLANS_WAIT_SECONDS - time.monotonic())
        )
        if not sending.done() or sending.cancelled() or sending.exception() is not None:
            return write.new
        refusals = sending.result()
        if not refusals or write.made_from is None:
            return write.new
        refused_from = replace(write.made_from, plan_errors=refusals)
        refused = observed_status(write.new, refused_from, utc_now())
        await self.write(written, status_write(write.new, refused), memory)
        return refused

    async def write(
        self, raw: Mapping[str, Any], write: StatusWrite, memory: Memory
    ) -> Mapping[str, Any]:
        """Write the status if it changed, then post Events for the transitions; the
        WeightSync as stored after (`raw` when nothing was written)."""
        body = write.new.to_k8s()
        if raw.get("status") == body:
            return raw  # what is stored already; `old` was parsed from it: no transitions
        meta = raw["metadata"]
        async with self.kube.writer.held():  # the status first (`apiwriter`)
            after = await self.kube.writer.patch_status(meta["namespace"], meta["name"], body)
        # A second write of a pass is made on its first (`cache.newest`).
        memory.seen_version = str(meta.get("resourceVersion"))
        memory.written = (memory.seen_version, after)
        for event in write.events:
            self.post_event(raw, event)
        return after


async def carry_out(
    recoveries: Recoveries,
    *,
    raw: Mapping[str, Any],
    agents: AgentClient,
    token: str,
    post_event: PostEvent,
    now: float,
    default_port: int,
) -> None:
    """Report the attempts that ended, then ask for the recoveries to start, together
    (a scale-up brings many pods to recover at once)."""
    for decision in recoveries.finished:
        _report(decision, post_event, raw)

    async def start(job: RecoveryStart) -> None:
        pod = job.pod
        address = AgentAddress(pod.name, pod.ip or "", pod.agent_port or default_port)
        answer = await agents.recover(
            address, job.request, token, peer_version=job.protocol_version
        )
        _started(
            pod.name, job.request, answer, tracker=job.tracker, post_event=post_event,
            raw=raw, now=now,
        )  # fmt: skip

    await asyncio.gather(*(start(job) for job in recoveries.starts))


def _report(decision: Decision, post_event: PostEvent, raw: Mapping[str, Any]) -> None:
    finished = decision.finished
    if finished is None:
        return
    if finished.state is RecoveryState.DONE:
        metrics.RECOVERIES.labels(metrics.RecoveryResult.DONE).inc()
        metrics.RECOVERY_DURATION.observe(finished.duration_millis / 1000)
        retry = 0.0
    else:
        metrics.RECOVERIES.labels(metrics.RecoveryResult.FAILED).inc()
        retry = backoff_seconds(decision.tracker.failures)
    post_event(raw, finished_event(decision.pod.name, finished, retry))


def _started(
    pod: str,
    request: RecoverRequest,
    answer: RecoveryStatus | str,
    *,
    tracker: Tracker,
    post_event: PostEvent,
    raw: Mapping[str, Any],
    now: float,
) -> None:
    if isinstance(answer, str):
        start_refused(tracker, now)
        metrics.RECOVERIES.labels(metrics.RecoveryResult.REFUSED).inc()
        message = reasons.RECOVERY_REFUSED_MESSAGE.format(
            pod=pod,
            version=request.version,
            error=answer,
            retry=f"{backoff_seconds(tracker.failures):g}",
        )
        post_event(raw, EventSpec("Warning", reasons.RECOVERY_FAILED, message))
        return
    metrics.RECOVERIES.labels(metrics.RecoveryResult.STARTED).inc()
    message = reasons.RECOVERY_STARTED_MESSAGE.format(
        pod=pod,
        version=request.version,
        holders=", ".join(request.holders),
        protocol=request.protocol.value,
    )
    post_event(raw, EventSpec("Normal", reasons.RECOVERY_STARTED, message))


def finished_event(pod: str, finished: RecoveryStatus, retry: float) -> EventSpec:
    """The Event for an attempt that ended (done or failed)."""
    used = ", ".join(finished.holders_used) or "no holder"
    if finished.state is RecoveryState.DONE:
        return EventSpec(
            "Normal",
            reasons.RECOVERED,
            reasons.RECOVERED_MESSAGE.format(
                pod=pod,
                version=finished.version,
                millis=finished.duration_millis,
                bytes=finished.bytes,
                bandwidth=finished.bandwidth_bytes_per_second,
                holders=used,
            ),
        )
    dropped = "; ".join(f"{url}: {why}" for url, why in finished.holders_failed.items())
    return EventSpec(
        "Warning",
        reasons.RECOVERY_FAILED,
        reasons.RECOVERY_FAILED_MESSAGE.format(
            pod=pod,
            version=finished.version,
            millis=finished.duration_millis,
            reason=finished.reason or "failed",
            message=finished.message,
            dropped=dropped or "none",
            retry=f"{retry:g}",
        ),
    )
