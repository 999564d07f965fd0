"""What the reconcile does to pods: recreate uninjected ones, set and release readiness gates.

The decisions are the pure functions of `workloads` and `readiness`; these functions
carry them out through the operator's one writer (`apiwriter`), on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from weightsync.api import parse_weightsync, reasons
from weightsync.api.base import format_timestamp, utc_now
from weightsync.api.v1alpha1 import Role, TrainerKind
from weightsync.api.validation import WeightSyncInvalidError
from weightsync.controller import names
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.cluster.events import PostEvent
from weightsync.controller.cluster.kube import Kube, pod_condition
from weightsync.controller.membership.owners import workload_refs
from weightsync.controller.membership.workloads import (
    PodView,
    parse_time,
    pods_to_recreate,
    sync_pods,
)
from weightsync.controller.readiness.gates import GateDecision
from weightsync.controller.status.observed import EventSpec

log = logging.getLogger(__name__)

# Pods created this long before their WeightSync were applied together with it.
APPLIED_TOGETHER_SECONDS = 300
# How long after the operator starts the API server may still admit pods without calling
# its webhook (it learns webhook configurations through a watch, a moment later).
WEBHOOK_SETTLE_SECONDS = 15
# A pod is recreated only this long after it was created: a ReplicaSet that sees a pod
# deleted before it saw it created waits out its expectations (5 minutes) before it
# makes another (seen in CI: a Colocated engine pod deleted 0.15 s after its creation).
RECREATE_AFTER = timedelta(seconds=2)


def uninjected(
    raw: Mapping[str, Any],
    pods: list[PodView],
    webhook_settling: tuple[datetime, datetime] | None,
    trainer_kind: TrainerKind,
    now: datetime,
) -> tuple[list[PodView], bool]:
    """Opted-in pods the webhook missed and would inject now (`pods_to_recreate`), at
    least `RECREATE_AFTER` old, and whether younger ones wait for a later pass. Pure.

    A Job's pod is never among them: its Job counts a deleted pod as a failed one (with
    `backoffLimit: 0` the Job fails, and a JobSet fails as a whole by default), so a Job
    or JobSet trainer that missed the webhook is reported (`SidecarMissing`), never
    deleted behind its owner's back."""
    created = parse_time(raw["metadata"].get("creationTimestamp"))
    window = timedelta(seconds=APPLIED_TOGETHER_SECONDS)
    found = pods_to_recreate(pods, created, window, webhook_settling)
    if trainer_kind is not TrainerKind.STATEFUL_SET:
        found = [pod for pod in found if pod.role is not Role.SOURCE]
    seen = now - RECREATE_AFTER  # created by then: its controller has seen it
    aged = [pod for pod in found if pod.created is not None and pod.created <= seen]
    return aged, len(aged) < len(found)


async def recreate(
    kube: Kube, post_event: PostEvent, raw: Mapping[str, Any], pods: Sequence[PodView]
) -> None:
    """Delete `pods` (`uninjected`); their controller recreates them."""
    spec = parse_weightsync(raw).spec  # the pass that chose `pods` parsed it already
    for pod in pods:
        namespace = raw["metadata"]["namespace"]
        await kube.delete_pod(namespace, pod.pod_name, pod.uid)
        entry = spec.inference[pod.inference_index or 0]
        kind = spec.trainer.kind if pod.role is Role.SOURCE else entry.kind
        message = reasons.POD_RECREATED_MESSAGE.format(pod=pod.pod_name, kind=kind)
        post_event(raw, EventSpec("Normal", reasons.POD_RECREATED, message))


async def set_gates(
    kube: Kube, namespace: str, pods: list[PodView], changes: list[GateDecision]
) -> None:
    """Write the weights-current condition of every pod in `changes` and wait for them,
    many at a time (`apiwriter`): a thousand gates one by one took 10 s. Every write is
    tried; the first failure is raised after. (Passes write theirs in the background,
    `gatesync`; a deleted WeightSync's finalizer waits for these.)"""
    if not changes:
        return
    now = format_timestamp(utc_now())
    by_name = {p.name: p for p in pods}

    async def write(decision: GateDecision) -> None:
        pod = by_name[decision.pod]
        # lastTransitionTime moves only when the status flips, as for any condition.
        since = pod.gate_since if pod.gate_status == decision.status_text else None
        log.debug(
            "gate of %s/%s: %s (%s)", namespace, pod.name, decision.status_text, decision.reason
        )
        condition = pod_condition(
            kind=names.WEIGHTS_CURRENT,
            status=decision.status_text,
            reason=decision.reason,
            message=decision.message,
            since=since or now,
        )
        await kube.writer.set_condition(namespace, decision.pod, condition)

    results = await asyncio.gather(*(write(d) for d in changes), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    opened = sum(1 for d in changes if d.status)
    log.info(
        "gates of %s: %d opened, %d closed (%s)%s",
        namespace, opened, len(changes) - opened,
        reasons.listing([f"{d.pod}: {d.status_text} ({d.reason})" for d in changes], shown=3),
        f"; {len(failed)} writes failed" if failed else "",
    )  # fmt: skip
    if failed:
        raise failed[0]


def restarting_behind_open_gate(pod: Mapping[str, Any]) -> bool:
    """A container of the pod is not ready (restarting in place) while its gate is open:
    the gate must close at once (`close_gate_at_once`), before the pass's agent polls,
    so the restarted engine cannot turn the pod Ready on the open gate."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return False
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    gate = conditions.get(names.WEIGHTS_CURRENT) or {}
    ready = conditions.get("ContainersReady") or {}
    return gate.get("status") == "True" and ready.get("status") == "False"


async def close_gate_at_once(kube: Kube, namespace: str, pod: str) -> None:
    """Close the gate of a pod `restarting_behind_open_gate`; the pass then decides from
    the agent's word."""
    log.info("gate of %s/%s: False (%s), at once", namespace, pod, reasons.CONTAINERS_NOT_READY)
    condition = pod_condition(
        kind=names.WEIGHTS_CURRENT,
        status="False",
        reason=reasons.CONTAINERS_NOT_READY,
        message=reasons.CONTAINERS_NOT_READY_MESSAGE,
        since=format_timestamp(utc_now()),
    )
    await kube.writer.set_condition(namespace, pod, condition)


async def release(kube: Kube, namespace: str, raw: Mapping[str, Any], indexes: Indexes) -> None:
    """Open every gate the WeightSync held, so a deleted WeightSync strands no pod NotReady."""
    try:
        sync = parse_weightsync(raw)
    except WeightSyncInvalidError:
        return  # an invalid WeightSync never gated a pod
    world = await asyncio.to_thread(kube.observe, namespace, *workload_refs(sync), indexes)
    message = reasons.WEIGHTSYNC_DELETED_MESSAGE.format(name=raw["metadata"]["name"])
    pods = sync_pods(sync, world)
    opened = [
        GateDecision(pod.name, True, reasons.WEIGHTSYNC_DELETED, message)
        for pod in pods
        if pod.has_gate and not pod.terminating and pod.gate_status != "True"
    ]
    await set_gates(kube, namespace, pods, opened)
