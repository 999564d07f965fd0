"""The pods of a WeightSync's workloads, and what the operator needs to know about each.

Which workload a pod belongs to, and a trainer pod's number, are `owners`' to say.
Everything here is pure: dicts in (as the API server sends them), dataclasses out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from weightsync.api.v1alpha1 import Role, WeightSync
from weightsync.controller import names
from weightsync.controller.membership.owners import (
    controller_ref,
    trainer_ordinal,
    trainer_pods,
)
from weightsync.controller.membership.trainer_ranks import (
    local_device,
    member_name,
    recorded_ranks,
    served_ranks,
    source_ranks,
)

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PodView:
    """What the reconcile reads from one pod of a WeightSync: one member of the group. A
    trainer pod whose sidecar serves several ranks is one view per rank (`trainer_ranks`):
    `name` is the member's name, `pod` the pod's."""

    name: str
    uid: str
    role: Role
    workload: str  # the name of the trainer or inference workload
    inference_index: int | None  # index into spec.inference for sinks
    ordinal: int | None  # trainer pods: the pod's number (`owners.trainer_ordinal`)
    ip: str | None
    node: str | None
    running: bool
    terminating: bool
    # Every container ready, but for an engine container whose readiness its agent
    # answers (`engine_unready`): that one running is enough to take part, since a round
    # or a recovery is what makes it ready again.
    containers_ready: bool
    has_agent: bool
    agent_port: int | None
    device: str  # where the agent holds its buckets: "cpu" or "cuda:N"
    has_gate: bool
    gate_status: str | None  # the weights-current condition's status, if any
    gate_reason: str | None
    gate_since: str | None  # its lastTransitionTime, kept while the status does not flip
    created: datetime | None
    labelled: bool  # carries weightsync.io/inject=true, i.e. opted in to injection
    finished: bool = False  # phase Failed or Succeeded: it will never take part again
    workload_started: datetime | None = None  # its containers' (not the agent's) last start
    # Not ready only by its engine's probe, which the agent answers: behind or unhealthy,
    # as the agent's status says (`admission.engine_probe`).
    engine_unready: bool = False
    pod: str = ""  # the pod's name ("": the member's name is the pod's)
    rank: int | None = None  # trainer pods: the global trainer rank this member publishes
    ranks_per_pod: int = 1  # trainer pods: ranks the pod runs

    @property
    def pod_name(self) -> str:
        return self.pod or self.name

    @property
    def live(self) -> bool:
        """It can take part, now or once started: not terminating, not finished."""
        return not self.terminating and not self.finished

    @property
    def joinable(self) -> bool:
        """Ready to be planned into a group: running, addressable, containers ready, agent in."""
        return (
            self.running
            and not self.terminating
            and self.ip is not None
            and self.containers_ready
            and self.has_agent
        )


def _condition(pod: Obj, kind: str) -> Obj | None:
    for item in (pod.get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            return item  # type: ignore[no-any-return]
    return None


def parse_time(value: object) -> datetime | None:
    """A timestamp as the API server (`...Z`) or the client's serializer (`+00:00`) writes it."""
    if not value:
        return None
    parsed = datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def pods_to_recreate(
    pods: Sequence[PodView],
    sync_created: datetime | None,
    window: timedelta,
    webhook_settling: tuple[datetime, datetime] | None = None,
) -> list[PodView]:
    """Opted-in pods the webhook could not inject, whose re-creation will inject them.

    * Pods that predate the WeightSync: when a WeightSync and its workloads are applied
      together (GitOps, `kubectl apply -f dir/`), the controllers may create pods before
      the WeightSync exists, and the webhook then finds nothing selecting them. Only pods
      created at most `window` before the WeightSync count: an older, serving workload is
      never restarted behind its owner's back (the reconcile reports it as Degraded).
    * Pods created while this operator's webhook was settling (`webhook_settling`: from
      its start until the API server has surely seen its webhook configuration, which it
      learns through a watch): admitted in that moment without a call, they would be
      injected now.

    Any other pod without the sidecar missed it while no operator ran, or while its
    webhook could not be reached (`failurePolicy: Ignore`); the reconcile reports it and
    leaves restarting it to its owner, so nothing loops and an outage never turns into
    a wave of deletions. Timestamps have whole seconds: a pod created in the
    WeightSync's second counts as applied together with it.
    """
    if sync_created is None:
        return []

    def missed(created: datetime) -> bool:
        if sync_created - window <= created <= sync_created:
            return True
        if webhook_settling is None:
            return False
        since, until = webhook_settling
        return since.replace(microsecond=0) <= created <= until

    found = {
        pod.uid: pod  # one per pod: a trainer pod of several ranks has a view for each
        for pod in pods
        if pod.labelled
        and not pod.has_agent
        and not pod.terminating
        and pod.created is not None
        and missed(pod.created)
    }
    return list(found.values())


def template_labelled(owner: Obj) -> bool:
    """Whether a controller's pod template opts its pods in (the inject label)."""
    template = (owner.get("spec") or {}).get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(names.INJECT_LABEL) == names.INJECT_VALUE)


VIEWS_KEPT = 20_000  # `pod_view`'s views by pod version: a few per pod of a large fleet
_VIEWS: dict[tuple[object, ...], PodView] = {}


def has_agent(pod: Obj) -> bool:
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return any(c.get("name") == names.AGENT_CONTAINER for c in containers)


def pod_view(
    pod: Obj, role: Role, workload: str, inference_index: int | None, ordinal: int | None
) -> PodView:
    """The view of a pod that is one member (an inference pod; a trainer pod of one rank).
    Kept by the pod's version: every pass views every pod, and at 1,000 pods making the
    views anew was a sixth of a pass's CPU."""
    meta = pod["metadata"]
    key = (meta["uid"], meta.get("resourceVersion"), role, workload, inference_index, ordinal)
    if key[1] is None:  # not as stored (built here, or by a test): nothing to key it by
        return _pod_view(pod, role, workload, inference_index, ordinal)
    found = _VIEWS.get(key)
    if found is None:
        if len(_VIEWS) >= VIEWS_KEPT:
            _VIEWS.clear()  # versions of pods long gone, mostly: start over
        found = _VIEWS[key] = _pod_view(pod, role, workload, inference_index, ordinal)
    return found


def _pod_view(
    pod: Obj, role: Role, workload: str, inference_index: int | None, ordinal: int | None
) -> PodView:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    port = annotations.get(names.AGENT_PORT_ANNOTATION)
    gate = _condition(pod, names.WEIGHTS_CURRENT)
    ready = _condition(pod, "ContainersReady")
    all_ready = ready is not None and ready.get("status") == "True"
    engine_unready = not all_ready and _only_engine_unready(
        annotations.get(names.ENGINE_READINESS_ANNOTATION), status
    )
    return PodView(
        name=meta["name"],
        uid=meta["uid"],
        role=role,
        workload=workload,
        inference_index=inference_index,
        ordinal=ordinal,
        ip=status.get("podIP") or None,
        node=spec.get("nodeName") or None,
        running=status.get("phase") == "Running",
        terminating=bool(meta.get("deletionTimestamp")),
        containers_ready=all_ready or engine_unready,
        has_agent=has_agent(pod),
        agent_port=int(port) if port and str(port).isdigit() else None,
        device=str(annotations.get(names.AGENT_DEVICE_ANNOTATION) or "cpu"),
        has_gate=any(
            gate_spec.get("conditionType") == names.WEIGHTS_CURRENT
            for gate_spec in spec.get("readinessGates") or []
        ),
        gate_status=gate.get("status") if gate else None,
        gate_reason=gate.get("reason") if gate else None,
        gate_since=gate.get("lastTransitionTime") if gate else None,
        created=parse_time(meta.get("creationTimestamp")),
        labelled=(meta.get("labels") or {}).get(names.INJECT_LABEL) == names.INJECT_VALUE,
        finished=status.get("phase") in ("Failed", "Succeeded"),
        workload_started=_workload_started(status),
        engine_unready=engine_unready,
    )


def _only_engine_unready(engine: str | None, status: Obj) -> bool:
    """Whether `engine` (the container whose probe the agent answers) is the one
    container not ready, and it runs."""
    if not engine:
        return False
    agent = [
        c
        for c in status.get("initContainerStatuses") or []
        if c.get("name") == names.AGENT_CONTAINER
    ]
    containers = [*agent, *(status.get("containerStatuses") or [])]
    unready = [c for c in containers if not c.get("ready")]
    return (
        len(agent) == 1
        and len(unready) == 1
        and unready[0].get("name") == engine
        and "running" in (unready[0].get("state") or {})
    )


def _workload_started(status: Obj) -> datetime | None:
    """The latest start (to the second) of a running container other than the agent."""
    running = [
        ((c.get("state") or {}).get("running") or {}).get("startedAt")
        for c in status.get("containerStatuses") or []
        if c.get("name") != names.AGENT_CONTAINER
    ]
    return max((t for t in map(parse_time, running) if t is not None), default=None)


def trainer_views(sync: WeightSync, pod: Obj, workload: str, ordinal: int) -> list[PodView]:
    """One view per rank the trainer pod's sidecar serves and the spec still publishes
    (a pod without the sidecar: the ranks it would be given)."""
    base = pod_view(pod, Role.SOURCE, workload, None, ordinal)
    served = recorded_ranks(pod) if base.has_agent else served_ranks(sync, ordinal)
    views = []
    for local in served.local:
        rank = served.global_rank(ordinal, local)
        if not sync.spec.trainer.publishes(rank):
            continue
        views.append(
            replace(
                base,
                name=member_name(base.name, local, served),
                pod=base.name,
                rank=rank,
                ranks_per_pod=served.per_pod,
                agent_port=None if base.agent_port is None else base.agent_port + local,
                device=local_device(base.device, local),
            )
        )
    return views


@dataclass(frozen=True, slots=True)
class World:
    """The API server's view of one WeightSync's workloads, read in one pass."""

    trainer: Obj | None  # the StatefulSet, JobSet or Job; None: not found
    engines: Mapping[str, Obj | None]  # Deployments and LeaderWorkerSets by name; None: not found
    # Between a workload and its pods: the Deployments' ReplicaSets, the LeaderWorkerSets'
    # leader StatefulSets, the JobSet's Jobs.
    controllers: Sequence[Obj]
    pods: Sequence[Obj]

    @property
    def inference_replicas(self) -> int:
        """The inference pods (engines) the workloads ask for: a Deployment's replicas, a
        LeaderWorkerSet's groups (`spec.replicas` of both; the API servers default it)."""
        return sum(
            int((obj.get("spec") or {}).get("replicas") or 0)
            for obj in self.engines.values()
            if obj is not None
        )


def _uid(obj: Obj | None) -> str | None:
    return (obj or {}).get("metadata", {}).get("uid") or None


def sync_pods(sync: WeightSync, world: World) -> list[PodView]:
    """Every live pod of the WeightSync's trainer source ranks (one view per rank) and
    inference workloads (a LeaderWorkerSet's leaders only: `owners`).

    Matching is by controller UID: pods of an older workload of the same name (deleted
    and recreated) never count.
    """
    views: list[PodView] = []
    trainer = sync.spec.trainer
    trainer_uid = _uid(world.trainer)
    engine_by_uid = {_uid(obj): name for name, obj in world.engines.items() if obj is not None}
    inference_index = {entry.name: i for i, entry in enumerate(sync.spec.inference)}
    # The controllers in between, by UID: (what their pods are, the workload's name, it).
    between: dict[str, tuple[Role, str, Obj]] = {}
    for obj in world.controllers:
        above = controller_ref(obj) or {}
        if trainer_uid and above.get("uid") == trainer_uid:
            between[obj["metadata"]["uid"]] = (Role.SOURCE, trainer.name, obj)
        elif above.get("uid") in engine_by_uid:
            between[obj["metadata"]["uid"]] = (Role.SINK, engine_by_uid[above["uid"]], obj)
    for pod in world.pods:
        owner = controller_ref(pod)
        if owner is None:
            continue
        uid = owner.get("uid")
        if trainer_uid and uid == trainer_uid:
            ordinal = trainer_ordinal(trainer.kind, pod, trainer.name)
            if ordinal is not None:
                views.extend(trainer_views(sync, pod, trainer.name, ordinal))
        elif uid in between:
            role, name, job = between[uid]
            if role is Role.SOURCE:
                ordinal = trainer_ordinal(trainer.kind, pod, name, job)
                if ordinal is not None:
                    views.extend(trainer_views(sync, pod, name, ordinal))
            else:
                views.append(pod_view(pod, Role.SINK, name, inference_index[name], None))
    return sorted(
        views, key=lambda v: (v.role != Role.SOURCE, v.rank or 0, v.inference_index or 0, v.name)
    )


def planned_sources(sync: WeightSync, world: World, pods: Sequence[PodView]) -> list[int]:
    """The trainer ranks the group waits for (`trainer_ranks.source_ranks`)."""
    count = None if world.trainer is None else trainer_pods(sync.spec.trainer.kind, world.trainer)
    per_pod = [p.ranks_per_pod for p in pods if p.role is Role.SOURCE]
    return source_ranks(sync, count, per_pod)
