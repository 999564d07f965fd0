"""What the operator reads from its watches instead of listing: kopf indexes, and the pods
of its own watch (`podwatch`).

Listing every pod each pass cost 1.7 s at 1,000 pods (7 MB of JSON turned into client
objects and back), in the process that also answers the pod webhook, and every admitted
pod listed every WeightSync. kopf already watches WeightSyncs and workloads; its indexes
keep what the passes and webhooks need from those watches, and kopf starts no handler
before they are filled (index pre-population), so a pass never sees half a namespace.

* labelled pods (the watch is filtered by the inject label on the server), by
  (namespace, controller owner uid), from `podwatch` (kopf cost 5 ms of CPU a pod event):
  a pass takes the pods of its StatefulSet and ReplicaSets with two lookups; until the
  first list is in, it lists them itself;
* WeightSyncs by namespace, spec and identity only (a status with 1,000 members is
  large and no claim check reads it);
* the trainer StatefulSets, JobSets and Jobs and the inference Deployments and
  LeaderWorkerSets by name, the ReplicaSets and Jobs by owning Deployment and JobSet (a
  LeaderWorkerSet's leader StatefulSet has its name): a pass reads no workload from the
  API server either; and each
  ReplicaSet's controlling Deployment by the ReplicaSet's name, for the pod webhook
  (a GET per admitted pod cost the API server and the webhook's latency at scale-up);
* each WeightSync whole, by name: a pass reads its own from here while the watch holds
  the newest version the pass knows of (`observe.Observer.read`).

Values are slim copies holding only the fields `workloads` reads, so 1,000 pods cost
about a megabyte. Pods without the inject label are not watched: a workload whose pod
template lacks it is listed instead (`kube.observe`), since its pods must still be
reported (`SidecarMissing`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from weightsync.controller import names
from weightsync.controller.membership.owners import controller_ref

WEIGHTSYNCS_INDEX = "weightsyncs_by_namespace"
STATEFULSETS_INDEX = "statefulsets_by_name"
DEPLOYMENTS_INDEX = "deployments_by_name"
REPLICASETS_INDEX = "replicasets_by_owner"
REPLICASET_OWNERS_INDEX = "replicaset_owners"
LEADERWORKERSETS_INDEX = "leaderworkersets_by_name"
JOBSETS_INDEX = "jobsets_by_name"
JOBS_INDEX = "jobs_by_name"
JOBS_BY_OWNER_INDEX = "jobs_by_owner"
BODIES_INDEX = "weightsync_bodies"
_INDEXES = (
    WEIGHTSYNCS_INDEX, STATEFULSETS_INDEX, DEPLOYMENTS_INDEX, REPLICASETS_INDEX,
    REPLICASET_OWNERS_INDEX, LEADERWORKERSETS_INDEX, JOBSETS_INDEX, JOBS_INDEX,
    JOBS_BY_OWNER_INDEX, BODIES_INDEX,
)  # fmt: skip
# The workloads by name, by kind (`Indexes.workload`).
_BY_NAME = {
    "StatefulSet": STATEFULSETS_INDEX, "Deployment": DEPLOYMENTS_INDEX,
    "LeaderWorkerSet": LEADERWORKERSETS_INDEX, "JobSet": JOBSETS_INDEX, "Job": JOBS_INDEX,
}  # fmt: skip

_POD_LABELS = (
    names.INJECT_LABEL, names.SYNC_LABEL, names.STATEFULSET_POD_INDEX_LABEL,
    names.JOB_COMPLETION_INDEX_LABEL, names.JOBSET_GLOBAL_INDEX_LABEL,
)  # fmt: skip
_POD_ANNOTATIONS = (
    names.AGENT_PORT_ANNOTATION,
    names.AGENT_DEVICE_ANNOTATION,
    names.RANKS_PER_POD_ANNOTATION,
    names.AGENT_RANKS_ANNOTATION,
    names.ENGINE_READINESS_ANNOTATION,
)
_POD_CONDITIONS = ("ContainersReady", names.WEIGHTS_CURRENT)


def _pick(source: Mapping[str, Any] | None, keys: Collection[str]) -> dict[str, Any]:
    return {k: v for k, v in (source or {}).items() if k in keys}


def slim_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a pod that `workloads.pod_view` and `sync_pods` read, in its shape."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    owner = controller_ref(pod)
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return {
        "metadata": {
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "uid": meta["uid"],
            "resourceVersion": meta.get("resourceVersion"),  # `pod_view` keeps views by it
            "creationTimestamp": meta.get("creationTimestamp"),
            "deletionTimestamp": meta.get("deletionTimestamp"),
            "labels": _pick(meta.get("labels"), _POD_LABELS),
            "annotations": _pick(meta.get("annotations"), _POD_ANNOTATIONS),
            "ownerReferences": [dict(owner)] if owner else [],
        },
        "spec": {
            "nodeName": spec.get("nodeName"),
            "readinessGates": [
                dict(g)
                for g in spec.get("readinessGates") or []
                if g.get("conditionType") == names.WEIGHTS_CURRENT
            ],
            # `has_agent` reads names only; init containers stand in for all of them.
            "initContainers": [{"name": c.get("name")} for c in containers],
        },
        "status": {
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "conditions": [
                {k: c.get(k) for k in ("type", "status", "reason", "lastTransitionTime")}
                for c in status.get("conditions") or []
                if c.get("type") in _POD_CONDITIONS
            ],
            # Which container is ready, and since when each runs: the gate's check that
            # a load postdates the engine's start (`readiness.loaded_before_start`), and
            # an engine container whose readiness its agent answers (`workloads`).
            "containerStatuses": _slim_containers(status.get("containerStatuses")),
            "initContainerStatuses": _slim_containers(status.get("initContainerStatuses")),
        },
    }


def _slim_containers(statuses: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    return [
        {
            "name": c.get("name"),
            "ready": c.get("ready"),
            "state": {k: v for k, v in (c.get("state") or {}).items() if k == "running"},
        }
        for c in statuses or []
    ]


def pod_key(namespace: str, pod: Mapping[str, Any]) -> tuple[str, str] | None:
    owner = controller_ref(pod)
    return (namespace, str(owner["uid"])) if owner and owner.get("uid") else None


def deployment_of(replicaset: Mapping[str, Any]) -> str | None:
    """The name of the Deployment controlling `replicaset`, if any."""
    owner = controller_ref(replicaset)
    return str(owner["name"]) if owner and owner.get("kind") == "Deployment" else None


def replicaset_owner(replicaset: Mapping[str, Any]) -> dict[str, Any]:
    """What the pod webhook needs of a ReplicaSet: its controlling Deployment's name."""
    return {"deployment": deployment_of(replicaset)}


def slim_weightsync(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A WeightSync without its status: what claim checks and the webhook parse."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": _pick(meta, ("name", "namespace", "uid", "creationTimestamp", "generation")),
        "spec": obj.get("spec") or {},
    }


def slim_workload(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A workload or a controller in between (StatefulSet, Deployment, ReplicaSet,
    LeaderWorkerSet, JobSet, Job): what `workloads`, `owners` and `kube.observe` read."""
    meta, spec = obj["metadata"], obj.get("spec") or {}
    owner = controller_ref(obj)
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    return {
        "metadata": {
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "uid": meta["uid"],
            "ownerReferences": [dict(owner)] if owner else [],
        },
        "spec": {
            "selector": spec.get("selector"),
            "replicas": spec.get("replicas"),
            "template": {"metadata": {"labels": _pick(labels, (names.INJECT_LABEL,))}},
            # A Job's pods, a JobSet's Jobs (`owners.trainer_pods`).
            "completions": spec.get("completions"),
            "replicatedJobs": [
                {
                    "replicas": job.get("replicas"),
                    "template": {
                        "spec": _pick((job.get("template") or {}).get("spec"), ("completions",))
                    },
                }
                for job in spec.get("replicatedJobs") or []
            ],
        },
        "status": {"replicas": (obj.get("status") or {}).get("replicas")},
    }


class PodsSource(Protocol):
    """Where `Indexes.pods_of` reads labelled pods (`podwatch.PodStore`)."""

    def pods_of(self, namespace: str, owner_uid: str) -> Sequence[Mapping[str, Any]] | None: ...


class Indexes:
    """kopf's index views, as handlers receive them, and the pod watch's store. kopf hands
    the same live objects to every handler; the first one bound makes them readable by
    passes started elsewhere (follow-ups, timers). Unbound (no handler ran yet, no pod
    list in yet) reads return None: list instead."""

    def __init__(self, pods: PodsSource | None = None) -> None:
        self._views: dict[str, Mapping[Any, Collection[Mapping[str, Any]]]] = {}
        self._pods = pods

    def bind(self, handler_kwargs: Mapping[str, Any]) -> None:
        for name in _INDEXES:
            view = handler_kwargs.get(name)
            if view is not None:
                self._views[name] = view

    def _get(self, index: str, key: object) -> list[Mapping[str, Any]] | None:
        view = self._views.get(index)
        # A list in one go: sync webhook handlers read from kopf's executor threads.
        return None if view is None else list(view.get(key, ()))

    def pods_of(self, namespace: str, owner_uid: str) -> Sequence[Mapping[str, Any]] | None:
        """The labelled pods a controller (StatefulSet, ReplicaSet) owns; None: unbound."""
        return None if self._pods is None else self._pods.pods_of(namespace, owner_uid)

    def weightsyncs(self, namespace: str) -> Sequence[Mapping[str, Any]] | None:
        """The namespace's WeightSyncs (spec and identity); None: unbound."""
        return self._get(WEIGHTSYNCS_INDEX, namespace)

    def workload(
        self, kind: str, namespace: str, name: str
    ) -> tuple[Mapping[str, Any] | None] | None:
        """(the workload of that kind, or None if there is none); None: unbound (for a
        LeaderWorkerSet or JobSet, also: its CRD is not installed, so not watched)."""
        found = self._get(_BY_NAME[kind], (namespace, name))
        return None if found is None else (found[0] if found else None,)

    def weightsync(self, namespace: str, name: str) -> tuple[Mapping[str, Any] | None] | None:
        """(the WeightSync as last watched, or None); None: unbound."""
        found = self._get(BODIES_INDEX, (namespace, name))
        return None if found is None else (found[0] if found else None,)

    def replicaset_owner(self, namespace: str, name: str) -> tuple[str | None] | None:
        """(the Deployment controlling ReplicaSet `name`, or None if it has none); None:
        unbound, or a ReplicaSet the watch has not brought yet (its pods can be admitted
        before that)."""
        found = self._get(REPLICASET_OWNERS_INDEX, (namespace, name))
        return (found[0].get("deployment"),) if found else None

    def replicasets_of(
        self, namespace: str, deployment_uid: str
    ) -> Sequence[Mapping[str, Any]] | None:
        """The ReplicaSets a Deployment controls; None: unbound."""
        return self._get(REPLICASETS_INDEX, (namespace, deployment_uid))

    def jobs_of(self, namespace: str, jobset_uid: str) -> Sequence[Mapping[str, Any]] | None:
        """The Jobs a JobSet controls; None: unbound."""
        return self._get(JOBS_BY_OWNER_INDEX, (namespace, jobset_uid))


def newest(
    watched: Mapping[str, Any] | None,
    seen_version: str | None,
    written: tuple[str, Mapping[str, Any]] | None,
) -> Mapping[str, Any] | None:
    """The newest WeightSync known without asking the API server, or None (ask it).

    `watched`: the object as the watch last brought it; `seen_version`: the version a
    pass last used; `written`: the last status write (the version it was made on, the
    object it returned). The watch's copy will do when it is that newest version; when
    it is the version the write was made on, the watch has not brought the write back
    yet and the write's reply is the newer. Anything else is a change no pass has seen.
    """
    if watched is None:
        return None
    version = watched["metadata"].get("resourceVersion")
    if written is not None:
        if version == written[0]:
            return written[1]
        if version == written[1]["metadata"].get("resourceVersion"):
            return watched
    return watched if version is not None and version == seen_version else None
