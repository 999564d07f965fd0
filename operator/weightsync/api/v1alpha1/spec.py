"""The desired state of a WeightSync (`spec`), v1alpha1."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import (
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from weightsync.api.base import INT64_MAX, ApiModel
from weightsync.api.cel import CelRule, located_error, validations
from weightsync.api.v1alpha1.agent import AgentSpec
from weightsync.api.v1alpha1.colocated import (
    COLOCATED_ONE_INFERENCE,
    COLOCATED_ONE_SOURCE,
    COLOCATED_ONLY,
    MODE_IMMUTABLE,
    ColocatedSpec,
    SyncMode,
)
from weightsync.api.v1alpha1.dataplane import (
    PrewarmSpec,
    ReadinessGateSpec,
    RecoverySpec,
    TransferSpec,
)
from weightsync.api.v1alpha1.front import COLOCATED_NO_FRONT, FRONT_NOT_ENGINE_PORT, FrontSpec
from weightsync.api.v1alpha1.workloads import (
    ENGINE_ONE_WORKLOAD,
    ENGINE_REFS,
    TRAINER_KIND_IMMUTABLE,
    TRAINER_ONE_WORKLOAD,
    TRAINER_REFS,
    DeploymentRef,
    EngineKind,
    JobRef,
    JobSetRef,
    LeaderWorkerSetRef,
    StatefulSetRef,
    TrainerKind,
)

MAX_INFERENCE_ENTRIES = 16
MAX_SOURCE_RANKS = 128
MAX_RANKS_PER_POD = 64
ALL_RANKS = "all"


class Engine(StrEnum):
    """The inference server behind an inference entry."""

    SGLANG = "SGLang"
    VLLM = "VLLM"
    REFERENCE = "Reference"


class PauseMode(StrEnum):
    """What an engine does with in-flight requests while it loads new weights."""

    ABORT = "Abort"
    WAIT = "Wait"
    KEEP = "Keep"


# An entry names one workload (ENGINE_ONE_WORKLOAD); the name is whichever ref is set,
# so a Deployment and a LeaderWorkerSet of one name are refused too (the operator keys
# its engines by name). An entry with no ref compares as "" and fails its own rule.
_ENGINE_NAME = (
    "(has({0}.deploymentRef) ? {0}.deploymentRef.name"
    " : has({0}.leaderWorkerSetRef) ? {0}.leaderWorkerSetRef.name : '')"
)
INFERENCE_UNIQUE = CelRule(
    rule=(
        f"self.all(a, self.exists_one(b, {_ENGINE_NAME.format('b')} == {_ENGINE_NAME.format('a')}))"
    ),
    message="inference entries must name distinct workloads (deploymentRef.name,"
    " leaderWorkerSetRef.name)",
)
# Each item is an int-or-string: a rank, or "all" alone. The schema cannot bound an
# int-or-string, so the rule does.
SOURCE_RANKS_FORM = CelRule(
    rule="self.all(r, type(r) == string ? (r == 'all' && size(self) == 1) : r >= 0)",
    message="sourceRanks lists trainer ranks (integers from 0), or is [all] alone",
)
# SGLang's pause modes are abort, retract and in_place: none stops admission and lets
# running requests finish first, which is what Wait promises.
SGLANG_CANNOT_WAIT = CelRule(
    rule="self.engine != 'SGLang' || !has(self.pauseMode) || self.pauseMode != 'Wait'",
    message="pauseMode Wait is not supported by SGLang, which cannot drain running requests"
    " while refusing new ones; use Abort or Keep",
    field_path=".pauseMode",
)


def _int_or_string(value: object) -> int | str:
    # Strict, as the API server: true is no integer. The list's rule checks the values.
    if type(value) is int or type(value) is str:
        return value
    raise located_error(f"must be of type integer or string, got {value!r}")


SourceRank = Annotated[
    int | str,
    PlainValidator(_int_or_string),
    WithJsonSchema({"x-kubernetes-int-or-string": True}),
]
"""A trainer rank, or "all" (strict: the string "3" is neither)."""


class TrainerSpec(ApiModel):
    """The trainer that publishes weights: one of statefulSetRef, jobSetRef, jobRef."""

    stateful_set_ref: StatefulSetRef | None = None
    """statefulSetRef names the trainer StatefulSet whose pods run the Publisher; pod
    ordinal i is trainer pod i."""

    job_set_ref: JobSetRef | None = None
    """jobSetRef names the trainer JobSet (jobset.x-k8s.io) whose pods run the Publisher."""

    job_ref: JobRef | None = None
    """jobRef names the trainer Job (an Indexed Job) whose pods run the Publisher; the pod
    of completion index i is trainer pod i."""

    source_ranks: list[SourceRank] = Field(
        default_factory=lambda: list[int | str]([0]),
        min_length=1,
        max_length=MAX_SOURCE_RANKS,
        json_schema_extra=validations(
            SOURCE_RANKS_FORM, default=[0], **{"x-kubernetes-list-type": "set"}
        ),
    )
    """sourceRanks lists the trainer ranks that publish weights, numbered as torchrun does:
    pod ordinal x ranksPerPod + local rank. Every listed rank calls publish each step and
    broadcasts what it holds (its FSDP or tensor-parallel shard, its experts); with a state
    dict gathered on one rank, list that rank alone. [all] names every rank of the trainer
    (replicas x ranksPerPod). Ranks are unique; the default is [0]."""

    ranks_per_pod: int | None = Field(default=None, strict=True, ge=1, le=MAX_RANKS_PER_POD)
    """ranksPerPod is how many trainer ranks (processes, as torchrun's --nproc-per-node)
    each trainer pod runs; the agent sidecar serves each of the pod's source ranks on its
    own GPU (local rank i on cuda:i, of the GPUs its ResourceClaims give the pod), socket
    and ports. Default 1: set it to the GPUs of each trainer pod."""

    @field_validator("source_ranks")
    @classmethod
    def _ranks_are_a_set(cls, ranks: list[int | str]) -> list[int | str]:
        # Mirrors `x-kubernetes-list-type: set`, which the API server reports at the
        # index of the second occurrence, and the rule on the list's form.
        seen: set[int | str] = set()
        for index, rank in enumerate(ranks):
            if rank in seen:
                raise located_error(f"Duplicate value: {rank!r}", f"[{index}]")
            seen.add(rank)
        for rank in ranks:
            if isinstance(rank, str) and (rank != ALL_RANKS or len(ranks) != 1):
                raise SOURCE_RANKS_FORM.violation()
            if isinstance(rank, int) and not 0 <= rank <= INT64_MAX:
                raise SOURCE_RANKS_FORM.violation()
        return ranks

    @model_validator(mode="after")
    def _one_workload(self) -> Self:
        if sum(getattr(self, attr) is not None for _, _, attr in TRAINER_REFS) != 1:
            raise TRAINER_ONE_WORKLOAD.violation()
        return self

    model_config = ConfigDict(
        json_schema_extra=validations(TRAINER_ONE_WORKLOAD, TRAINER_KIND_IMMUTABLE)
    )

    @property
    def kind(self) -> TrainerKind:
        """The kind of the trainer workload (the one reference set)."""
        return next(kind for kind, _, attr in TRAINER_REFS if getattr(self, attr) is not None)

    @property
    def name(self) -> str:
        """The name of the trainer workload."""
        ref = next(getattr(self, attr) for _, _, attr in TRAINER_REFS if getattr(self, attr))
        return str(ref.name)

    @property
    def all_ranks(self) -> bool:
        """Whether every trainer rank publishes (`sourceRanks: [all]`)."""
        return self.source_ranks == [ALL_RANKS]

    def listed_ranks(self) -> list[int]:
        """The listed ranks, in order (none when every rank publishes)."""
        return sorted(r for r in self.source_ranks if isinstance(r, int))

    def colocatable(self) -> bool:
        """Whether the source ranks can feed one engine on their GPUs (Colocated): one
        rank, or every rank of one pod (`[all]` with `ranksPerPod` set: the operator
        waits, saying so, while the trainer has several pods)."""
        listed, per_pod = self.listed_ranks(), self.ranks_per_pod
        if len(self.source_ranks) == 1 and len(listed) == 1:
            return True
        if per_pod is None:
            return False
        if self.all_ranks:
            return True
        return len(listed) == per_pod and len({rank // per_pod for rank in listed}) == 1

    def publishes(self, rank: int) -> bool:
        return self.all_ranks or rank in self.source_ranks


class InferenceSpec(ApiModel):
    """One inference workload that receives the trainer's weights: one of deploymentRef,
    leaderWorkerSetRef."""

    deployment_ref: DeploymentRef | None = None
    """deploymentRef names an inference Deployment; every pod it runs becomes a sink."""

    leader_worker_set_ref: LeaderWorkerSetRef | None = None
    """leaderWorkerSetRef names an inference LeaderWorkerSet; every group's leader pod
    becomes a sink (one engine per group)."""

    engine: Engine
    """engine is the inference server the workload runs: SGLang, VLLM, or Reference
    (weightsync's own small engine for tests and demos)."""

    port: int = Field(strict=True, ge=1, le=65535)
    """port is the engine's HTTP port inside the pod; the agent sidecar talks to the engine
    on localhost at this port to pause it, load weights and read its health."""

    pause_mode: PauseMode = PauseMode.ABORT
    """pauseMode says what the engine does with in-flight requests while it loads a new
    version. Abort (the default, as in SGLang and vLLM) aborts them and the client retries;
    Wait stops admitting requests and lets in-flight ones finish on the old weights first,
    which delays the round; Keep freezes them and continues them on the new weights, so
    their tokens mix two versions."""

    flush_cache: StrictBool = True
    """flushCache clears the engine's prefix (KV) cache after a new version is loaded.
    Cached prefixes were computed with the old weights; turn this off only if stale cache
    entries are acceptable for your rollouts."""

    front: FrontSpec | None = None
    """front keeps the engine's update routes to its own agent: the engine listens on the
    pod's loopback (`--host 127.0.0.1`) and the agent serves its clients on front.port,
    refusing those routes. Unset, the engine's port is open to every pod that reaches it.
    Not supported in Colocated mode."""

    @model_validator(mode="after")
    def _one_workload(self) -> Self:
        if sum(getattr(self, attr) is not None for _, _, attr in ENGINE_REFS) != 1:
            raise ENGINE_ONE_WORKLOAD.violation()
        return self

    @property
    def kind(self) -> EngineKind:
        """The kind of the inference workload (the one reference set)."""
        return next(kind for kind, _, attr in ENGINE_REFS if getattr(self, attr) is not None)

    @property
    def name(self) -> str:
        """The name of the inference workload."""
        ref = next(getattr(self, attr) for _, _, attr in ENGINE_REFS if getattr(self, attr))
        return str(ref.name)

    @model_validator(mode="after")
    def _engine_supports_pause_mode(self) -> Self:
        if self.engine == Engine.SGLANG and self.pause_mode == PauseMode.WAIT:
            raise SGLANG_CANNOT_WAIT.violation()
        return self

    @model_validator(mode="after")
    def _front_apart_from_engine(self) -> Self:
        if self.front is not None and self.front.port == self.port:
            raise FRONT_NOT_ENGINE_PORT.violation()
        return self

    model_config = ConfigDict(
        json_schema_extra=validations(
            ENGINE_ONE_WORKLOAD, SGLANG_CANNOT_WAIT, FRONT_NOT_ENGINE_PORT
        )
    )


class WeightSyncSpec(ApiModel):
    """The desired state of a WeightSync."""

    trainer: TrainerSpec
    """trainer is the workload (StatefulSet, JobSet or Indexed Job) that trains and
    publishes weights."""

    inference: list[InferenceSpec] = Field(
        min_length=1,
        max_length=MAX_INFERENCE_ENTRIES,
        json_schema_extra=validations(INFERENCE_UNIQUE, **{"x-kubernetes-list-type": "atomic"}),
    )
    """inference lists the workloads (Deployments, LeaderWorkerSets) that receive the
    weights, 1 to 16 entries, each naming a distinct workload."""

    mode: SyncMode = Field(
        default=SyncMode.DISAGGREGATED, json_schema_extra=validations(MODE_IMMUTABLE)
    )
    """mode is Disaggregated (the default: trainer and engines on separate GPUs, weights
    broadcast over NCCL) or Colocated (trainer and one engine share GPUs on each node,
    weights handed over by CUDA IPC). It cannot change after creation."""

    colocated: ColocatedSpec | None = None
    """colocated says what the engine gives back while the trainer trains; Colocated mode
    only."""

    transfer: TransferSpec = Field(default_factory=TransferSpec, json_schema_extra={"default": {}})
    """transfer tunes how rounds move the weights."""

    prewarm: PrewarmSpec = Field(default_factory=PrewarmSpec, json_schema_extra={"default": {}})
    """prewarm controls warming the collective group before the first round."""

    recovery: RecoverySpec = Field(default_factory=RecoverySpec, json_schema_extra={"default": {}})
    """recovery controls how restarted inference pods catch up with the current version."""

    readiness_gate: ReadinessGateSpec = Field(
        default_factory=ReadinessGateSpec, json_schema_extra={"default": {}}
    )
    """readinessGate controls holding inference pods NotReady until they serve the current
    version."""

    agent: AgentSpec = Field(default_factory=AgentSpec, json_schema_extra={"default": {}})
    """agent adds to the injected sidecar what the cluster's fabric needs (env, resources,
    claims, volume mounts, IPC_LOCK)."""

    @field_validator("inference")
    @classmethod
    def _distinct_deployments(cls, entries: list[InferenceSpec]) -> list[InferenceSpec]:
        names = [entry.name for entry in entries]
        if len(set(names)) != len(names):
            raise INFERENCE_UNIQUE.violation()
        return entries

    @model_validator(mode="after")
    def _colocated_has_one_engine(self) -> Self:
        if self.mode is SyncMode.COLOCATED and len(self.inference) != 1:
            raise COLOCATED_ONE_INFERENCE.violation()
        if self.mode is SyncMode.COLOCATED and not self.trainer.colocatable():
            raise COLOCATED_ONE_SOURCE.violation()
        if self.mode is SyncMode.COLOCATED and any(e.front for e in self.inference):
            raise COLOCATED_NO_FRONT.violation()
        if self.mode is not SyncMode.COLOCATED and self.colocated is not None:
            raise COLOCATED_ONLY.violation()
        return self

    model_config = ConfigDict(
        json_schema_extra=validations(
            COLOCATED_ONE_INFERENCE, COLOCATED_ONE_SOURCE, COLOCATED_NO_FRONT, COLOCATED_ONLY
        )
    )
