"""Admission: inject the agent into selected pods; refuse WeightSyncs that claim taken workloads.

Design (why a webhook outage never blocks unrelated pods):

* **Pods** - mutating, CREATE only, `failurePolicy: Ignore`, and an `objectSelector`
  on `weightsync.io/inject=true`. Users put that label on the pod templates of their
  trainer StatefulSet and inference Deployments (the chart's docs say so). The API
  server never calls the webhook for any other pod, so an outage (or a slow operator:
  kopf sets the 30 s maximum timeout) can only delay labelled pods, never unrelated
  ones; and `Ignore` admits even labelled pods unmodified. Such a pod is not lost: the
  reconcile sees a selected pod without the sidecar and reports `Degraded=True`
  (`SidecarMissing`), naming the pods to delete. Inside the webhook a labelled pod is
  matched to a WeightSync by its controller owner chain (`owners`: StatefulSet,
  ReplicaSet -> Deployment, StatefulSet -> LeaderWorkerSet, Job, Job -> JobSet; each
  link read from a watch, else one GET), never by labels alone; a labelled pod that no WeightSync
  selects is admitted unchanged. The handler raises only to refuse a pod on purpose (an
  error *denies* the pod, which `Ignore` does not cover): one whose GPUs come from a
  device plugin, which its sidecar cannot share (`gpu_access`), and an engine that
  `spec.colocated.memoryRelease` asks to free memory whose command line cannot be given
  the flag for it (`engine_sleep`); the ReplicaSet's or StatefulSet's FailedCreate Event
  carries the reason.
* **WeightSyncs** - validating, CREATE and UPDATE, `failurePolicy: Fail`: only our own
  resource is affected by an outage. It checks what the CRD cannot: that no older
  WeightSync in the namespace already syncs one of the named workloads. It does not
  require the workloads to exist (GitOps applies everything at once); the reconcile
  reports missing ones as `Ready=False`. The same claim check runs at reconcile time as
  the backstop for WeightSyncs admitted while the webhook was away. It also refuses a
  `front.port` that is one of the agent's own ports, which are the operator's settings
  (an agent given one anyway exits at start saying so).

Both webhooks are non-persistent: kopf removes them from the configurations when the
operator stops cleanly, so a stopped operator leaves no webhook behind to time out on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jsonpatch
import kopf

from weightsync.api import parse_weightsync
from weightsync.api.v1alpha1 import WeightSync
from weightsync.api.validation import WeightSyncInvalidError
from weightsync.controller import metrics
from weightsync.controller.admission.engine_sleep import EngineCannotSleepError
from weightsync.controller.admission.gpu_access import GpusNotShareableError
from weightsync.controller.admission.injection import injection_patch
from weightsync.controller.admission.patches import JsonPatch
from weightsync.controller.admission.sidecar import AgentTemplate, sink_agent_ports
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.membership.owners import (
    WorkloadRef,
    claim_conflicts,
    claims,
    controller_ref,
    select_target,
)

log = logging.getLogger(__name__)


def parse_all(raws: Sequence[Mapping[str, Any]]) -> list[WeightSync]:
    """The WeightSyncs that parse; an invalid one syncs nothing, so it selects nothing."""
    result = []
    for raw in raws:
        try:
            result.append(parse_weightsync(raw))
        except WeightSyncInvalidError:
            continue
    return result


def older_than(
    raw: Mapping[str, Any], others: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The WeightSyncs created before `raw` (creationTimestamp, then name): older claims win."""

    def key(obj: Mapping[str, Any]) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        # A WeightSync being created has no timestamp yet: it is the newest.
        return (str(meta.get("creationTimestamp") or "9999"), str(meta.get("name") or ""))

    mine = key(raw)
    return [other for other in others if key(other) < mine]


class OwnerLookups(Protocol):
    """What the webhook asks about the controllers between a pod and its workload."""

    def replicaset_owner(self, name: str) -> str | None:
        """The Deployment controlling ReplicaSet `name`, if any."""

    def statefulset_owner(self, name: str) -> Mapping[str, Any] | None:
        """The controller reference of StatefulSet `name`, if any."""

    def job(self, name: str) -> Mapping[str, Any] | None:
        """Job `name`, if it exists."""


@dataclass(frozen=True)
class KubeLookups:
    """`OwnerLookups` from the watches (`indexes`), else one GET each."""

    kube: Kube
    namespace: str
    indexes: Indexes | None

    def replicaset_owner(self, name: str) -> str | None:
        return self.kube.replicaset_owner(self.namespace, name, self.indexes)

    def statefulset_owner(self, name: str) -> Mapping[str, Any] | None:
        return self.kube.statefulset_owner(self.namespace, name, self.indexes)

    def job(self, name: str) -> Mapping[str, Any] | None:
        return self.kube.job(self.namespace, name, self.indexes)


def workload_of(
    pod: Mapping[str, Any], lookups: OwnerLookups
) -> tuple[WorkloadRef, Mapping[str, Any] | None] | None:
    """The workload a pod belongs to (`owners` gives the chains), and for a JobSet's pod
    its Job (whose completions number the pod). A LeaderWorkerSet's worker pods and any
    pod of a chain not listed there belong to none."""
    owner = controller_ref(pod)
    if owner is None:
        return None
    kind, name = owner.get("kind"), str(owner.get("name"))
    if kind == "ReplicaSet":
        deployment = lookups.replicaset_owner(name)
        return (WorkloadRef("Deployment", deployment), None) if deployment else None
    if kind == "StatefulSet":
        above = lookups.statefulset_owner(name)
        return _unless_above(WorkloadRef(kind, name), above, "LeaderWorkerSet"), None
    if kind == "Job":
        job = lookups.job(name)
        above = controller_ref(job) if job is not None else None
        return _unless_above(WorkloadRef(kind, name), above, "JobSet"), job
    return None


def _unless_above(ref: WorkloadRef, above: Mapping[str, Any] | None, kind: str) -> WorkloadRef:
    """`ref`, or the workload of `kind` controlling it (`above`: its controller reference)."""
    if above is not None and above.get("kind") == kind:
        return WorkloadRef(kind, str(above["name"]))
    return ref


def pod_patch(
    kube: Kube,
    pod: Mapping[str, Any],
    namespace: str,
    template: AgentTemplate,
    indexes: Indexes | None = None,
) -> JsonPatch:
    """The injection patch for a labelled pod being created (empty: leave it alone).
    WeightSyncs and the controllers above the pod come from the watches (`indexes`), read
    from the API server only before they are bound (or for one newer than its watch)."""
    found = workload_of(pod, KubeLookups(kube, namespace, indexes))
    if found is None:
        return []
    workload, job = found
    target = select_target(workload, pod, parse_all(kube.weightsyncs(namespace, indexes)), job)
    if target is None:
        return []
    return injection_patch(
        pod,
        sync=target.sync,
        role=target.role,
        inference_index=target.inference_index,
        namespace=namespace,
        template=template,
        served=target.served,
    )


def apply_patch(ops: JsonPatch) -> Callable[[kopf.RawBody], None]:
    """A kopf patch function: kopf re-derives the JSON patch from the body it produces."""

    def apply(body: kopf.RawBody) -> None:
        jsonpatch.JsonPatch(ops).apply(body, in_place=True)

    return apply


def set_patch(patch: kopf.Patch, ops: JsonPatch) -> None:
    """Make `ops` the admission response's patch. kopf would apply them to a copy of the
    pod and diff the whole pod to derive them again (`Patch.as_json_patch`: 2 ms of the
    event loop per pod, most of the webhook's own time in a scale-up, while the
    ReplicaSet controller waits on each). The ops are that patch already; the function
    stays in `fns` for anything else that applies the patch to a body."""
    patch.fns.append(apply_patch(ops))
    setattr(patch, "as_json_patch", lambda body=None: list(ops))  # noqa: B010 - a method


def inject(
    kube: Kube,
    template: AgentTemplate,
    body: Mapping[str, Any],
    patch: Any,
    indexes: Indexes | None = None,
) -> None:
    """The mutating handler's body. Raises only to refuse a pod whose GPUs cannot reach
    its sidecar or whose engine cannot sleep as asked; any other error admits the pod
    unchanged (the reconcile reports it)."""
    meta = body.get("metadata") or {}
    namespace = str(meta.get("namespace") or "")
    try:
        ops = pod_patch(kube, body, namespace, template, indexes)
    except (GpusNotShareableError, EngineCannotSleepError) as exc:
        metrics.ADMISSIONS.labels("inject-agent", metrics.AdmissionResult.DENIED).inc()
        log.warning("refusing a pod in %s: %s", namespace, exc)
        raise kopf.AdmissionError(f"weightsync: {exc}", code=403) from exc
    except Exception:
        log.exception(
            "could not decide injection for a pod in %s; admitting it unchanged", namespace
        )
        metrics.ADMISSIONS.labels("inject-agent", metrics.AdmissionResult.ERROR).inc()
        return
    if not ops:
        metrics.ADMISSIONS.labels("inject-agent", metrics.AdmissionResult.SKIPPED).inc()
        log.info(
            "admitting %s/%s unchanged: no WeightSync selects it, or it has the agent",
            namespace,
            meta.get("name") or meta.get("generateName"),
        )
        return
    set_patch(patch, ops)
    metrics.ADMISSIONS.labels("inject-agent", metrics.AdmissionResult.INJECTED).inc()
    log.info(
        "injecting the agent into %s/%s", namespace, meta.get("name") or meta.get("generateName")
    )


def claim_errors(
    body: Mapping[str, Any], old: Mapping[str, Any] | None, listing: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Why a WeightSync create or update must be refused (empty: admit it)."""
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return []  # finalizer removal and the like: never block a deletion
    if old is not None and old.get("spec") == body.get("spec"):
        return []  # metadata or status only (the operator's own writes)
    try:
        candidate = parse_weightsync(body)
    except WeightSyncInvalidError:
        return []  # the schema and CEL rules answer for the spec itself
    name = (body.get("metadata") or {}).get("name")
    others = [o for o in listing if (o.get("metadata") or {}).get("name") != name]
    older = older_than(body, others)
    errors = claim_conflicts(candidate, parse_all(older))
    # A workload this change newly names must be free of newer WeightSyncs too: an older
    # one patched to name a newer one's workload would otherwise take it over, and the
    # newer one would go `WorkloadClaimed` without a word to the user who patched.
    added = claims(candidate) - _claims_of(old)
    newer = parse_all([o for o in others if o not in older])
    for other in sorted(newer, key=lambda s: s.metadata.name or ""):
        errors.extend(
            f"{ref.kind} {ref.name} is already synced by WeightSync {other.metadata.name}"
            for ref in sorted(added & claims(other), key=lambda r: (r.kind, r.name))
        )
    return errors


def front_errors(body: Mapping[str, Any], template: AgentTemplate) -> list[str]:
    """Why a WeightSync's fronts cannot be served by its sidecars (empty: they can)."""
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return []
    try:
        candidate = parse_weightsync(body)
    except WeightSyncInvalidError:
        return []  # the schema and CEL rules answer for the spec itself
    taken = sink_agent_ports(template)
    return [
        f"spec.inference[{index}].front.port: {entry.front.port} is {taken[entry.front.port]}"
        " in the injected sidecar; choose another port"
        for index, entry in enumerate(candidate.spec.inference)
        if entry.front is not None and entry.front.port in taken
    ]


def _claims_of(raw: Mapping[str, Any] | None) -> set[WorkloadRef]:
    if raw is None:
        return set()
    try:
        return claims(parse_weightsync(raw))
    except WeightSyncInvalidError:
        return set()
