"""One pass's recoveries: decided (`decide_recoveries`, pure, from
`recovery.plan_recoveries`), then carried out (`carry_out`: post requests, report
outcomes, count them).

The decisions say which pods the pass must hold out of the next generation, and whether a
recovery is in flight (the reconciler then polls sooner); carrying them out talks to the
agents, posts the Events and feeds the metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.api import reasons
from weightsync.api.control import AgentStatus, RecoverRequest, RecoveryState, RecoveryStatus
from weightsync.api.v1alpha1 import RecoveryProtocol, WeightSyncSpec
from weightsync.controller import metrics
from weightsync.controller.agents import AgentAddress, AgentClient
from weightsync.controller.pods import EventPoster
from weightsync.controller.readiness import Current
from weightsync.controller.recovery import (
    Decision,
    Step,
    Tracker,
    backoff_seconds,
    plan_recoveries,
    start_refused,
)
from weightsync.controller.status import EventSpec
from weightsync.controller.workloads import PodView

# What the agent is given for a whole pull: the round timeout scaled up, since a pull of
# the full model over TCP is far slower than one broadcast round, with a floor.
MIN_RECOVERY_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True, slots=True)
class RecoveryPass:
    held_out: frozenset[str]  # pod names not to plan yet
    in_flight: bool  # a recovery runs or waits for its backoff: poll again soon
    watched: frozenset[str] = frozenset()  # the pods whose progress the follow-up polls


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


def request_for(
    spec: WeightSyncSpec, current: Current, holders: Sequence[str], protocol: RecoveryProtocol
) -> RecoverRequest:
    """`protocol`: what the holders serve (`pull_protocol.pull_over`), never `Auto`."""
    timeout = max(MIN_RECOVERY_TIMEOUT_SECONDS, 10.0 * spec.transfer.timeout_seconds)
    return RecoverRequest(
        version=current.version or 0,
        lineage=current.lineage or "",
        holders=list(holders),
        protocol=protocol,
        timeout_seconds=timeout,
    )


@dataclass(frozen=True, slots=True)
class RecoveryStart:
    """A recovery to ask a pod's agent for; `tracker` is the pod's (a refusal counts in it)."""

    pod: PodView
    request: RecoverRequest
    tracker: Tracker


@dataclass(frozen=True, slots=True)
class Recoveries:
    """One pass's recovery decisions: the trackers after it (by pod uid), the attempts
    that ended to report, the recoveries to start, and what the pass does meanwhile."""

    trackers: dict[str, Tracker]
    finished: tuple[Decision, ...]
    starts: tuple[RecoveryStart, ...]
    held: RecoveryPass


def decide_recoveries(
    *,
    spec: WeightSyncSpec,
    current: Current,
    pods: Sequence[PodView],
    statuses: Mapping[str, AgentStatus],
    trackers: Mapping[str, Tracker],
    now: float,
    default_port: int,
) -> Recoveries:
    """One pass of recovery decisions (`recovery.plan_recoveries`); `trackers` is left
    as it was."""
    live = {p.uid for p in pods}
    after = {uid: tracker for uid, tracker in trackers.items() if uid in live}
    decisions = plan_recoveries(
        spec,
        current,
        pods=pods,
        statuses=statuses,
        trackers=after,
        now=now,
        default_port=default_port,
    )
    held_out: set[str] = set()
    watched: set[str] = set()
    starts = []
    for decision in decisions:
        tracker = after[decision.pod.uid] = decision.tracker
        if decision.step is Step.START and current.version is not None:
            request = request_for(spec, current, decision.holders, decision.protocol)
            starts.append(RecoveryStart(decision.pod, request, tracker))
        if decision.step is not Step.ADMIT:
            watched.add(decision.pod.name)
            if not decision.in_group:
                held_out.add(decision.pod.name)
    held = RecoveryPass(frozenset(held_out), in_flight=bool(watched), watched=frozenset(watched))
    finished = tuple(d for d in decisions if d.finished is not None)
    return Recoveries(after, finished, tuple(starts), held)


async def carry_out(
    recoveries: Recoveries,
    *,
    raw: Mapping[str, Any],
    agents: AgentClient,
    token: str,
    post_event: EventPoster,
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
        answer = await agents.recover(address, job.request, token)
        _started(
            pod.name, job.request, answer, tracker=job.tracker, post_event=post_event,
            raw=raw, now=now,
        )  # fmt: skip

    await asyncio.gather(*(start(job) for job in recoveries.starts))


def _report(decision: Decision, post_event: EventPoster, raw: Mapping[str, Any]) -> None:
    finished = decision.finished
    if finished is None:
        return
    if finished.state is RecoveryState.DONE:
        metrics.RECOVERIES.labels("done").inc()
        metrics.RECOVERY_DURATION.observe(finished.duration_millis / 1000)
        retry = 0.0
    else:
        metrics.RECOVERIES.labels("failed").inc()
        retry = backoff_seconds(decision.tracker.failures)
    post_event(raw, finished_event(decision.pod.name, finished, retry))


def _started(
    pod: str,
    request: RecoverRequest,
    answer: RecoveryStatus | str,
    *,
    tracker: Tracker,
    post_event: EventPoster,
    raw: Mapping[str, Any],
    now: float,
) -> None:
    if isinstance(answer, str):
        start_refused(tracker, now)
        metrics.RECOVERIES.labels("refused").inc()
        message = reasons.RECOVERY_REFUSED_MESSAGE.format(
            pod=pod,
            version=request.version,
            error=answer,
            retry=f"{backoff_seconds(tracker.failures):g}",
        )
        post_event(raw, EventSpec("Warning", reasons.RECOVERY_FAILED, message))
        return
    metrics.RECOVERIES.labels("started").inc()
    message = reasons.RECOVERY_STARTED_MESSAGE.format(
        pod=pod,
        version=request.version,
        holders=", ".join(request.holders),
        protocol=request.protocol.value,
    )
    post_event(raw, EventSpec("Normal", reasons.RECOVERY_STARTED, message))
