"""Which pods belong to a WeightSync, and what the operator needs to know about each.

A pod belongs to a WeightSync through its *controller owner chain*, not through
labels: a trainer pod is controlled by the named StatefulSet; an inference pod by a
ReplicaSet that is controlled by the named Deployment. Label selectors overlap
(two Deployments may both select `app: engine`), and a pod's labels can be edited
by anyone; controller references are set by the workload controllers themselves and
cannot point at two owners. The reconcile matches by owner UID; the webhook, which
sees a pod before it has a name, matches by owner name (`admission`).

Everything here is pure: dicts in (as the API server sends them), dataclasses out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from weightsync.api.v1alpha1 import Role, WeightSync
from weightsync.controller import names
from weightsync.controller.membership.trainer_ranks import (
    ServedRanks,
    local_device,
    member_name,
    recorded_ranks,
    served_ranks,
    source_ranks,
)

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class WorkloadRef:
    """The workload that controls a pod: a StatefulSet or (through a ReplicaSet) a Deployment."""

    kind: str  # "StatefulSet" | "Deployment"
    name: str


@dataclass(frozen=True, slots=True)
class PodView:
    """What the reconcile reads from one pod of a WeightSync: one member of the group. A
    trainer pod whose sidecar serves several ranks is one view per rank (`trainer_ranks`):
    `name` is the member's name, `pod` the pod's."""

    name: str
    uid: str
    role: Role
    workload: str  # the StatefulSet or Deployment name
    inference_index: int | None  # index into spec.inference for sinks
    ordinal: int | None  # StatefulSet ordinal for trainer pods
    ip: str | None
    node: str | None
    running: bool
    terminating: bool
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


def controller_ref(obj: Obj) -> Obj | None:
    """The ownerReference with `controller: true`, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref  # type: ignore[no-any-return]
    return None


def statefulset_ordinal(pod: Obj, statefulset: str) -> int | None:
    """A StatefulSet pod's ordinal: its `apps.kubernetes.io/pod-index` label, else its name."""
    meta = pod.get("metadata") or {}
    label = (meta.get("labels") or {}).get(names.STATEFULSET_POD_INDEX_LABEL)
    if label is not None and str(label).isdigit():
        return int(label)
    found = re.fullmatch(rf"{re.escape(statefulset)}-(\d+)", str(meta.get("name") or ""))
    return int(found.group(1)) if found else None


def claims(sync: WeightSync) -> set[WorkloadRef]:
    """The workloads a WeightSync names."""
    refs = {WorkloadRef("StatefulSet", sync.spec.trainer.stateful_set_ref.name)}
    refs.update(
        WorkloadRef("Deployment", entry.deployment_ref.name) for entry in sync.spec.inference
    )
    return refs


def claim_conflicts(candidate: WeightSync, others: Iterable[WeightSync]) -> list[str]:
    """Messages for every workload `candidate` names that another WeightSync already names."""
    mine = claims(candidate)
    conflicts: list[str] = []
    for other in sorted(others, key=lambda s: s.metadata.name or ""):
        if other.metadata.name == candidate.metadata.name:
            continue
        shared = sorted(mine & claims(other), key=lambda r: (r.kind, r.name))
        conflicts.extend(
            f"{ref.kind} {ref.name} is already synced by WeightSync {other.metadata.name}"
            for ref in shared
        )
    return conflicts


@dataclass(frozen=True, slots=True)
class Target:
    """Why a pod gets a sidecar: which WeightSync selects it, and as what."""

    sync: WeightSync
    role: Role
    inference_index: int | None
    ordinal: int | None
    served: ServedRanks | None = None  # trainer pods: the ranks its sidecar serves


def select_target(workload: WorkloadRef, pod: Obj, syncs: Sequence[WeightSync]) -> Target | None:
    """The WeightSync (first by name if several claim it) that selects this pod, or None.

    Trainer pods are selected only if one of their ranks is a source rank: the other
    trainer ranks never talk to an agent, so a pod of only those gets no sidecar.
    """
    for sync in sorted(syncs, key=lambda s: s.metadata.name or ""):
        if (
            workload.kind == "StatefulSet"
            and workload.name == sync.spec.trainer.stateful_set_ref.name
        ):
            ordinal = statefulset_ordinal(pod, workload.name)
            if ordinal is None:
                return None
            served = served_ranks(sync, ordinal)
            return Target(sync, Role.SOURCE, None, ordinal, served) if served.local else None
        if workload.kind == "Deployment":
            for index, entry in enumerate(sync.spec.inference):
                if entry.deployment_ref.name == workload.name:
                    return Target(sync, Role.SINK, index, None)
    return None


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
        containers_ready=ready is not None and ready.get("status") == "True",
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

    statefulset: Obj | None
    deployments: Mapping[str, Obj | None]  # by name; None: not found
    replicasets: Sequence[Obj]
    pods: Sequence[Obj]

    @property
    def inference_replicas(self) -> int:
        """The inference pods the Deployments ask for (`spec.replicas`: the API server
        defaults it, so it is always set on a stored Deployment)."""
        return sum(
            int((obj.get("spec") or {}).get("replicas") or 0)
            for obj in self.deployments.values()
            if obj is not None
        )


def sync_pods(sync: WeightSync, world: World) -> list[PodView]:
    """Every live pod of the WeightSync's trainer source ranks (one view per rank) and
    inference Deployments.

    Matching is by controller UID: pods of an older StatefulSet or Deployment of the
    same name (deleted and recreated) never count.
    """
    views: list[PodView] = []
    trainer = sync.spec.trainer.stateful_set_ref.name
    sts_uid = (world.statefulset or {}).get("metadata", {}).get("uid")
    deployment_by_uid = {
        obj["metadata"]["uid"]: name for name, obj in world.deployments.items() if obj is not None
    }
    inference_index = {entry.deployment_ref.name: i for i, entry in enumerate(sync.spec.inference)}
    rs_to_deployment: dict[str, str] = {}
    for rs in world.replicasets:
        owner = controller_ref(rs)
        if owner and owner.get("kind") == "Deployment" and owner.get("uid") in deployment_by_uid:
            rs_to_deployment[rs["metadata"]["uid"]] = deployment_by_uid[owner["uid"]]
    for pod in world.pods:
        owner = controller_ref(pod)
        if owner is None:
            continue
        if owner.get("kind") == "StatefulSet" and sts_uid and owner.get("uid") == sts_uid:
            ordinal = statefulset_ordinal(pod, trainer)
            if ordinal is not None:
                views.extend(trainer_views(sync, pod, trainer, ordinal))
        elif owner.get("kind") == "ReplicaSet" and owner.get("uid") in rs_to_deployment:
            deployment = rs_to_deployment[owner["uid"]]
            views.append(pod_view(pod, Role.SINK, deployment, inference_index[deployment], None))
    return sorted(
        views, key=lambda v: (v.role != Role.SOURCE, v.rank or 0, v.inference_index or 0, v.name)
    )


def planned_sources(sync: WeightSync, world: World, pods: Sequence[PodView]) -> list[int]:
    """The trainer ranks the group waits for (`trainer_ranks.source_ranks`)."""
    replicas = ((world.statefulset or {}).get("spec") or {}).get("replicas")
    per_pod = [p.ranks_per_pod for p in pods if p.role is Role.SOURCE]
    return source_ranks(sync, replicas if isinstance(replicas, int) else None, per_pod)
