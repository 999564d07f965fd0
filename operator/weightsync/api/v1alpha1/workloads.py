"""The workloads a WeightSync binds, v1alpha1: one reference field per kind.

A trainer is a StatefulSet (ranks from pod ordinals), a JobSet (jobset.x-k8s.io:
ranks from each pod's Job index and completion index) or an Indexed Job (ranks from
completion indexes). An engine is a Deployment (every pod one engine) or a
LeaderWorkerSet (leaderworkerset.x-k8s.io: every group of a leader and its workers one
engine, served by its leader). Each kind has its own field, as Kubernetes unions do
(volume sources): exactly one is set, so a WeightSync written before the other kinds
existed (`statefulSetRef`, `deploymentRef`) means what it always meant.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from weightsync.api.base import ApiModel, ObjectName
from weightsync.api.cel import CelRule, RuleReason, validations


class TrainerKind(StrEnum):
    """The kind of a trainer workload."""

    STATEFUL_SET = "StatefulSet"
    JOB_SET = "JobSet"
    JOB = "Job"


class EngineKind(StrEnum):
    """The kind of an inference workload."""

    DEPLOYMENT = "Deployment"
    LEADER_WORKER_SET = "LeaderWorkerSet"


# The reference fields, as (kind, field in the CRD, attribute in Python).
TRAINER_REFS = (
    (TrainerKind.STATEFUL_SET, "statefulSetRef", "stateful_set_ref"),
    (TrainerKind.JOB_SET, "jobSetRef", "job_set_ref"),
    (TrainerKind.JOB, "jobRef", "job_ref"),
)
ENGINE_REFS = (
    (EngineKind.DEPLOYMENT, "deploymentRef", "deployment_ref"),
    (EngineKind.LEADER_WORKER_SET, "leaderWorkerSetRef", "leader_worker_set_ref"),
)


def _has_each(fields: tuple[tuple[object, str, str], ...], on: str = "self") -> list[str]:
    return [f"has({on}.{field})" for _, field, _ in fields]


def _exactly_one(fields: tuple[tuple[object, str, str], ...]) -> str:
    return f"[{', '.join(_has_each(fields))}].filter(x, x).size() == 1"


TRAINER_ONE_WORKLOAD = CelRule(
    rule=_exactly_one(TRAINER_REFS),
    message="trainer names its workload in exactly one of statefulSetRef, jobSetRef, jobRef",
)
TRAINER_KIND_IMMUTABLE = CelRule(
    rule=" && ".join(
        f"{new} == {old}"
        for new, old in zip(
            _has_each(TRAINER_REFS), _has_each(TRAINER_REFS, "oldSelf"), strict=True
        )
    ),
    message=(
        "the trainer's workload kind is immutable: weight versions are the trainer's steps,"
        " so a new trainer needs a new WeightSync"
    ),
    reason=RuleReason.FORBIDDEN,
)
ENGINE_ONE_WORKLOAD = CelRule(
    rule=_exactly_one(ENGINE_REFS),
    message="an inference entry names its workload in exactly one of deploymentRef,"
    " leaderWorkerSetRef",
)


def _name_immutable(field: str) -> CelRule:
    return CelRule(
        rule="self == oldSelf",
        message=(
            f"trainer.{field}.name is immutable: weight versions are the trainer's steps,"
            " so a new trainer needs a new WeightSync"
        ),
        reason=RuleReason.FORBIDDEN,
    )


TRAINER_IMMUTABLE = _name_immutable("statefulSetRef")
JOBSET_IMMUTABLE = _name_immutable("jobSetRef")
JOB_IMMUTABLE = _name_immutable("jobRef")


class StatefulSetRef(ApiModel):
    """A StatefulSet in the WeightSync's namespace."""

    name: ObjectName = Field(json_schema_extra=validations(TRAINER_IMMUTABLE))
    """name is the name of the trainer StatefulSet; it cannot change after creation."""


class JobSetRef(ApiModel):
    """A JobSet (jobset.x-k8s.io/v1alpha2) in the WeightSync's namespace."""

    name: ObjectName = Field(json_schema_extra=validations(JOBSET_IMMUTABLE))
    """name is the name of the trainer JobSet; it cannot change after creation. Its pods
    are numbered as JobSet's own PyTorch examples number nodes: the Job's
    jobset.sigs.k8s.io/job-global-index x the Job's completions + the pod's
    batch.kubernetes.io/job-completion-index (its Jobs are Indexed Jobs of equal size)."""


class JobRef(ApiModel):
    """A Job (batch/v1, completionMode Indexed) in the WeightSync's namespace."""

    name: ObjectName = Field(json_schema_extra=validations(JOB_IMMUTABLE))
    """name is the name of the trainer Job, an Indexed Job; it cannot change after
    creation. Its pods are numbered by batch.kubernetes.io/job-completion-index."""


class DeploymentRef(ApiModel):
    """A Deployment in the WeightSync's namespace."""

    name: ObjectName
    """name is the name of the inference Deployment."""


class LeaderWorkerSetRef(ApiModel):
    """A LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) in the WeightSync's namespace."""

    name: ObjectName
    """name is the name of the inference LeaderWorkerSet. Each of its groups (a leader
    and its workers) is one engine, served by the leader: the leader pod gets the agent
    sidecar and is the sink; the workers' GPUs are reached through the engine itself."""
