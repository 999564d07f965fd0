"""Carry out the recovery decisions of one pass: post requests, report outcomes, count them.

The decisions are `recovery.plan_recoveries`; this module talks to the agents, posts the
Events and feeds the metrics. It returns the pods the pass must hold out of the next
generation, and whether a recovery is in flight (the reconciler then polls sooner).
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


async def run_recoveries(
    *,
    raw: Mapping[str, Any],
    spec: WeightSyncSpec,
    current: Current,
    pods: Sequence[PodView],
    statuses: Mapping[str, AgentStatus],
    trackers: dict[str, Tracker],
    agents: AgentClient,
    token: str,
    post_event: EventPoster,
    now: float,
    default_port: int,
) -> RecoveryPass:
    """One pass of recovery work; `trackers` (by pod uid) is updated in place."""
    live = {p.uid for p in pods}
    for uid in [uid for uid in trackers if uid not in live]:
        del trackers[uid]
    decisions = plan_recoveries(
        spec,
        current,
        pods=pods,
        statuses=statuses,
        trackers=trackers,
        now=now,
        default_port=default_port,
    )
    held_out: set[str] = set()
    watched: set[str] = set()
    starts = []
    for decision in decisions:
        tracker = trackers[decision.pod.uid] = decision.tracker
        _report(decision, post_event, raw)
        if decision.step is Step.START and current.version is not None:
            starts.append((decision.pod, tracker))
        if decision.step is not Step.ADMIT:
            watched.add(decision.pod.name)
            if not decision.in_group:
                held_out.add(decision.pod.name)

    async def start(pod: PodView, tracker: Tracker) -> None:
        address = AgentAddress(pod.name, pod.ip or "", pod.agent_port or default_port)
        chosen = starting[pod.name]
        request = request_for(spec, current, chosen.holders, chosen.protocol)
        answer = await agents.recover(address, request, token)
        _started(
            pod.name, request, answer, tracker=tracker, post_event=post_event, raw=raw, now=now
        )

    starting = {d.pod.name: d for d in decisions}
    # A scale-up brings many pods to recover at once: ask them all together.
    await asyncio.gather(*(start(pod, tracker) for pod, tracker in starts))
    return RecoveryPass(frozenset(held_out), in_flight=bool(watched), watched=frozenset(watched))


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
