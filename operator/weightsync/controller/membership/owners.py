"""Which workload a pod belongs to, what number a trainer pod has, and which WeightSync
selects it. Pure: dicts in (as the API server sends them), values out.

A pod belongs to a WeightSync through its *controller owner chain*, not through
labels: label selectors overlap (two Deployments may both select `app: engine`), and a
pod's labels can be edited by anyone; controller references are set by the workload
controllers themselves and cannot point at two owners. The chains, as the controllers
build them (LWS v0.7, JobSet v0.10):

* StatefulSet trainer: pod -> StatefulSet.
* Indexed Job trainer: pod -> Job.
* JobSet trainer: pod -> Job -> JobSet.
* Deployment engine: pod -> ReplicaSet -> Deployment.
* LeaderWorkerSet engine: leader pod -> leader StatefulSet (named as the LWS) -> LWS.
  A worker pod's chain is pod -> worker StatefulSet -> leader pod: it belongs to no
  WeightSync. A group is one engine, served by its leader; the leader's sidecar reaches
  the engine's HTTP API, and the workers' GPUs are loaded by the engine itself (vLLM and
  SGLang spread a weight update over their tensor/pipeline-parallel workers), so workers
  get no sidecar.

The reconcile matches by owner UID; the webhook, which sees a pod before it has a name,
matches by owner name (`admission`).

Trainer pods are numbered from what their controller set on them: a StatefulSet's
ordinal; an Indexed Job's `batch.kubernetes.io/job-completion-index`; in a JobSet,
`jobset.sigs.k8s.io/job-global-index` x the Job's completions + the completion index,
as JobSet's PyTorch examples number nodes. A trainer rank is that number x ranksPerPod
+ local rank, as torchrun's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.api.v1alpha1 import Role, TrainerKind, WeightSync
from weightsync.controller import names
from weightsync.controller.membership.trainer_ranks import ServedRanks, served_ranks

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class WorkloadRef:
    """A workload a WeightSync names: a trainer (StatefulSet, JobSet, Job) or an engine
    (Deployment, LeaderWorkerSet)."""

    kind: str
    name: str


def controller_ref(obj: Obj) -> Obj | None:
    """The ownerReference with `controller: true`, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref  # type: ignore[no-any-return]
    return None


def _label_index(obj: Obj, key: str) -> int | None:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(key)
    return int(value) if value is not None and str(value).isdigit() else None


def statefulset_ordinal(pod: Obj, statefulset: str) -> int | None:
    """A StatefulSet pod's ordinal: its `apps.kubernetes.io/pod-index` label, else its name."""
    label = _label_index(pod, names.STATEFULSET_POD_INDEX_LABEL)
    if label is not None:
        return label
    name = str((pod.get("metadata") or {}).get("name") or "")
    found = re.fullmatch(rf"{re.escape(statefulset)}-(\d+)", name)
    return int(found.group(1)) if found else None


def pods_per_job(job: Obj | None) -> int | None:
    """An Indexed Job's pods: its completions (the API server requires them for Indexed)."""
    completions = ((job or {}).get("spec") or {}).get("completions")
    return completions if isinstance(completions, int) and completions > 0 else None


def trainer_ordinal(kind: str, pod: Obj, trainer: str, job: Obj | None = None) -> int | None:
    """The number of trainer pod `pod` (None: its controller has not numbered it).
    `job`: for a JobSet trainer, the pod's Job (its completions)."""
    if kind == TrainerKind.STATEFUL_SET:
        return statefulset_ordinal(pod, trainer)
    completion = _label_index(pod, names.JOB_COMPLETION_INDEX_LABEL)
    if kind == TrainerKind.JOB or completion is None:
        return completion
    job_index, per_job = _label_index(pod, names.JOBSET_GLOBAL_INDEX_LABEL), pods_per_job(job)
    if job_index is None or per_job is None:
        return None
    return job_index * per_job + completion


def trainer_pods(kind: str, trainer: Obj) -> int | None:
    """How many pods the trainer workload runs (None: it does not say)."""
    spec = trainer.get("spec") or {}
    if kind == TrainerKind.STATEFUL_SET:
        replicas = spec.get("replicas")
        return replicas if isinstance(replicas, int) else None
    if kind == TrainerKind.JOB:
        return pods_per_job(trainer)
    total = 0
    for replicated in spec.get("replicatedJobs") or []:
        per_job = pods_per_job(replicated.get("template"))
        if per_job is None:
            return None
        total += int(replicated.get("replicas") or 1) * per_job
    return total or None


def workload_refs(sync: WeightSync) -> tuple[WorkloadRef, list[WorkloadRef]]:
    """The trainer workload and the inference workloads (in spec order) a WeightSync names."""
    trainer = sync.spec.trainer
    return WorkloadRef(trainer.kind, trainer.name), [
        WorkloadRef(entry.kind, entry.name) for entry in sync.spec.inference
    ]


def claims(sync: WeightSync) -> set[WorkloadRef]:
    """The workloads a WeightSync names."""
    refs = {WorkloadRef(sync.spec.trainer.kind, sync.spec.trainer.name)}
    refs.update(WorkloadRef(entry.kind, entry.name) for entry in sync.spec.inference)
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


def select_target(
    workload: WorkloadRef, pod: Obj, syncs: Sequence[WeightSync], job: Obj | None = None
) -> Target | None:
    """The WeightSync (first by name if several claim it) that selects this pod, or None.
    `job`: a JobSet trainer pod's Job.

    Trainer pods are selected only if one of their ranks is a source rank: the other
    trainer ranks never talk to an agent, so a pod of only those gets no sidecar.
    """
    for sync in sorted(syncs, key=lambda s: s.metadata.name or ""):
        trainer = sync.spec.trainer
        if workload.kind == trainer.kind and workload.name == trainer.name:
            ordinal = trainer_ordinal(trainer.kind, pod, trainer.name, job)
            if ordinal is None:
                return None
            served = served_ranks(sync, ordinal)
            return Target(sync, Role.SOURCE, None, ordinal, served) if served.local else None
        for index, entry in enumerate(sync.spec.inference):
            if workload.kind == entry.kind and workload.name == entry.name:
                return Target(sync, Role.SINK, index, None)
    return None
