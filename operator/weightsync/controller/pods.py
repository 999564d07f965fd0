"""What the reconcile does to pods: recreate uninjected ones, set and release readiness gates.

The decisions are the pure functions of `workloads` and `readiness`; these functions
carry them out through the (blocking) API client, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from weightsync.api import parse_weightsync, reasons
from weightsync.api.base import format_timestamp, utc_now
from weightsync.api.control import AgentStatus
from weightsync.api.v1alpha1 import Role
from weightsync.api.validation import WeightSyncInvalidError
from weightsync.controller import names
from weightsync.controller.kube import Kube
from weightsync.controller.readiness import Current, gate_changes
from weightsync.controller.status import EventSpec
from weightsync.controller.workloads import PodView, parse_time, pods_to_recreate, sync_pods

log = logging.getLogger(__name__)

# Pods created this long before their WeightSync were applied together with it.
APPLIED_TOGETHER_SECONDS = 300
# How long after the operator starts the API server may still admit pods without calling
# its webhook (it learns webhook configurations through a watch, a moment later).
WEBHOOK_SETTLE_SECONDS = 15

EventPoster = Callable[[Mapping[str, Any], EventSpec], None]


async def recreate_uninjected(
    kube: Kube,
    post_event: EventPoster,
    raw: Mapping[str, Any],
    pods: list[PodView],
    webhook_settling: tuple[datetime, datetime],
) -> None:
    """Delete opted-in pods the webhook missed and would inject now (`pods_to_recreate`);
    their controller recreates them."""
    created = parse_time(raw["metadata"].get("creationTimestamp"))
    window = timedelta(seconds=APPLIED_TOGETHER_SECONDS)
    for pod in pods_to_recreate(pods, created, window, webhook_settling):
        namespace = raw["metadata"]["namespace"]
        await asyncio.to_thread(kube.delete_pod, namespace, pod.pod_name, pod.uid)
        kind = "StatefulSet" if pod.role is Role.SOURCE else "Deployment"
        message = reasons.POD_RECREATED_MESSAGE.format(pod=pod.pod_name, kind=kind)
        post_event(raw, EventSpec("Normal", reasons.POD_RECREATED, message))


async def set_gates(
    kube: Kube,
    namespace: str,
    pods: list[PodView],
    *,
    statuses: Mapping[str, AgentStatus],
    errors: Mapping[str, str],
    current: Current,
    reached: frozenset[str] | None = None,
) -> None:
    """Write the weights-current condition on every gated pod whose condition must change
    (`reached`: the pods the next round reaches, `readiness.rounds_reach`)."""
    now = format_timestamp(utc_now())
    by_name = {p.name: p for p in pods}
    for decision in gate_changes(pods, statuses, errors, current, reached):
        pod = by_name[decision.pod]
        # lastTransitionTime moves only when the status flips, as for any condition.
        since = pod.gate_since if pod.gate_status == decision.status_text else None
        log.info(
            "gate of %s/%s: %s (%s)", namespace, pod.name, decision.status_text, decision.reason
        )
        await asyncio.to_thread(
            kube.set_pod_condition,
            namespace,
            decision.pod,
            kind=names.WEIGHTS_CURRENT,
            status=decision.status_text,
            reason=decision.reason,
            message=decision.message,
            since=since or now,
        )


async def close_gate_if_restarting(kube: Kube, namespace: str, pod: Mapping[str, Any]) -> bool:
    """Close an open gate at once when a container of the pod is not ready (restarting in
    place): before the pass's agent polls, so the restarted engine cannot turn the pod
    Ready on the open gate. The pass then decides from the agent's word."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return False
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    gate = conditions.get(names.WEIGHTS_CURRENT) or {}
    ready = conditions.get("ContainersReady") or {}
    if gate.get("status") != "True" or ready.get("status") != "False":
        return False
    log.info(
        "gate of %s/%s: False (%s), at once", namespace, meta["name"], reasons.CONTAINERS_NOT_READY
    )
    await asyncio.to_thread(
        kube.set_pod_condition,
        namespace,
        meta["name"],
        kind=names.WEIGHTS_CURRENT,
        status="False",
        reason=reasons.CONTAINERS_NOT_READY,
        message=reasons.CONTAINERS_NOT_READY_MESSAGE,
        since=format_timestamp(utc_now()),
    )
    return True


async def release(kube: Kube, namespace: str, raw: Mapping[str, Any]) -> None:
    """Open every gate the WeightSync held, so a deleted WeightSync strands no pod NotReady."""
    try:
        sync = parse_weightsync(raw)
    except WeightSyncInvalidError:
        return  # an invalid WeightSync never gated a pod
    spec = sync.spec
    world = await asyncio.to_thread(
        kube.observe,
        namespace,
        spec.trainer.stateful_set_ref.name,
        [entry.deployment_ref.name for entry in spec.inference],
    )
    now = format_timestamp(utc_now())
    message = reasons.WEIGHTSYNC_DELETED_MESSAGE.format(name=raw["metadata"]["name"])
    for pod in sync_pods(sync, world):
        if pod.has_gate and not pod.terminating and pod.gate_status != "True":
            await asyncio.to_thread(
                kube.set_pod_condition,
                namespace,
                pod.name,
                kind=names.WEIGHTS_CURRENT,
                status="True",
                reason=reasons.WEIGHTSYNC_DELETED,
                message=message,
                since=now,
            )
