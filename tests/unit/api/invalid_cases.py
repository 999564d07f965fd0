"""Invalid WeightSyncs, shared by the unit tests (Python backstop) and the cluster
tests (the real API server), so both are held to the same field paths.

`path` is where both report the problem; `server_says` is a fragment of the API
server's message; `rule`, when set, is the CEL rule whose message both print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.unit.api.builders import weightsync
from weightsync.api.cel import CelRule
from weightsync.api.v1alpha1.agent import ENV_NOT_RESERVED, NO_GPU_OF_ITS_OWN
from weightsync.api.v1alpha1.colocated import (
    COLOCATED_ONE_INFERENCE,
    COLOCATED_ONE_SOURCE,
    COLOCATED_ONLY,
    MODE_IMMUTABLE,
)
from weightsync.api.v1alpha1.dataplane import STAGING_LIMIT
from weightsync.api.v1alpha1.front import COLOCATED_NO_FRONT, FRONT_NOT_ENGINE_PORT
from weightsync.api.v1alpha1.spec import INFERENCE_UNIQUE, SGLANG_CANNOT_WAIT, SOURCE_RANKS_FORM
from weightsync.api.v1alpha1.workloads import (
    ENGINE_ONE_WORKLOAD,
    JOBSET_IMMUTABLE,
    TRAINER_IMMUTABLE,
    TRAINER_KIND_IMMUTABLE,
    TRAINER_ONE_WORKLOAD,
)

GIB = 1 << 30


@dataclass(frozen=True)
class Invalid:
    id: str
    manifest: dict[str, Any]
    path: str
    server_says: str
    rule: CelRule | None = None
    unknown_field: bool = False
    """Rejected only under strict field validation (otherwise the API server prunes it)."""


def _many_engines(count: int) -> dict[str, Any]:
    builder = weightsync()
    for index in range(1, count):
        builder.inference(f"engine-{index}")
    return builder.build()


CREATE_CASES = [
    Invalid(
        "unknown-engine",
        weightsync().set("spec.inference.0.engine", "Triton").build(),
        "spec.inference[0].engine",
        'Unsupported value: "Triton"',
    ),
    Invalid(
        "engine-in-lower-case",
        weightsync().set("spec.inference.0.engine", "sglang").build(),
        "spec.inference[0].engine",
        'Unsupported value: "sglang"',
    ),
    Invalid(
        "unknown-mode",
        weightsync().set("spec.mode", "Hybrid").build(),
        "spec.mode",
        'Unsupported value: "Hybrid"',
    ),
    Invalid(
        "unknown-recovery-protocol",
        weightsync().set("spec.recovery.protocol", "InfiniBand").build(),
        "spec.recovery.protocol",
        'Unsupported value: "InfiniBand"',
    ),
    Invalid(
        "unknown-pause-mode",
        weightsync().set("spec.inference.0.pauseMode", "Drain").build(),
        "spec.inference[0].pauseMode",
        'Unsupported value: "Drain"',
    ),
    Invalid(
        "zero-bucket-size",
        weightsync().set("spec.transfer.bucketSizeBytes", 0).build(),
        "spec.transfer.bucketSizeBytes",
        "should be greater than or equal to 1048576",
    ),
    Invalid(
        "absurd-bucket-size",
        weightsync().set("spec.transfer.bucketSizeBytes", 1024 * GIB).build(),
        "spec.transfer.bucketSizeBytes",
        "should be less than or equal to 17179869184",
    ),
    Invalid(
        "bucket-size-not-whole-mebibytes",
        weightsync().set("spec.transfer.bucketSizeBytes", 512 * 1024 * 1024 + 1).build(),
        "spec.transfer.bucketSizeBytes",
        "should be a multiple of 1048576",
    ),
    Invalid(
        "bucket-size-as-string",
        weightsync().set("spec.transfer.bucketSizeBytes", "512Mi").build(),
        "spec.transfer.bucketSizeBytes",
        "must be of type integer",
    ),
    Invalid(
        "staging-memory-over-16-gib",
        weightsync()
        .set("spec.transfer.bucketSizeBytes", 8 * GIB)
        .set("spec.transfer.pipelineDepth", 4)
        .build(),
        "spec.transfer",
        STAGING_LIMIT.message,
        rule=STAGING_LIMIT,
    ),
    Invalid(
        "pipeline-depth-too-deep",
        weightsync().set("spec.transfer.pipelineDepth", 5).build(),
        "spec.transfer.pipelineDepth",
        "should be less than or equal to 4",
    ),
    Invalid(
        "pipeline-depth-zero",
        weightsync().set("spec.transfer.pipelineDepth", 0).build(),
        "spec.transfer.pipelineDepth",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "transfer-timeout-zero",
        weightsync().set("spec.transfer.timeoutSeconds", 0).build(),
        "spec.transfer.timeoutSeconds",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "prewarm-timeout-over-an-hour",
        weightsync().set("spec.prewarm.timeoutSeconds", 3601).build(),
        "spec.prewarm.timeoutSeconds",
        "should be less than or equal to 3600",
    ),
    Invalid(
        "checksum-as-string",
        weightsync().set("spec.transfer.checksum", "yes").build(),
        "spec.transfer.checksum",
        "must be of type boolean",
    ),
    Invalid(
        "too-many-holders",
        weightsync().set("spec.recovery.holders", 9).build(),
        "spec.recovery.holders",
        "should be less than or equal to 8",
    ),
    Invalid(
        "missing-trainer",
        weightsync().delete("spec.trainer").build(),
        "spec.trainer",
        "Required value",
    ),
    Invalid(
        "missing-trainer-reference",
        weightsync().delete("spec.trainer.statefulSetRef").build(),
        "spec.trainer",
        TRAINER_ONE_WORKLOAD.message,
        rule=TRAINER_ONE_WORKLOAD,
    ),
    Invalid(
        "two-trainer-references",
        weightsync().set("spec.trainer.jobSetRef", {"name": "train"}).build(),
        "spec.trainer",
        TRAINER_ONE_WORKLOAD.message,
        rule=TRAINER_ONE_WORKLOAD,
    ),
    Invalid(
        "missing-engine-reference",
        weightsync().delete("spec.inference.0.deploymentRef").build(),
        "spec.inference[0]",
        ENGINE_ONE_WORKLOAD.message,
        rule=ENGINE_ONE_WORKLOAD,
    ),
    Invalid(
        "two-engine-references",
        weightsync().set("spec.inference.0.leaderWorkerSetRef", {"name": "lws"}).build(),
        "spec.inference[0]",
        ENGINE_ONE_WORKLOAD.message,
        rule=ENGINE_ONE_WORKLOAD,
    ),
    Invalid(
        "leaderworkerset-name-not-dns",
        weightsync()
        .delete("spec.inference.0.deploymentRef")
        .set("spec.inference.0.leaderWorkerSetRef", {"name": "Engine_A"})
        .build(),
        "spec.inference[0].leaderWorkerSetRef.name",
        "should match",
    ),
    Invalid(
        "deployment-and-leaderworkerset-of-one-name",
        weightsync()
        .inference("engine-b")
        .delete("spec.inference.1.deploymentRef")
        .set("spec.inference.1.leaderWorkerSetRef", {"name": "engine-a"})
        .build(),
        "spec.inference",
        INFERENCE_UNIQUE.message,
        rule=INFERENCE_UNIQUE,
    ),
    Invalid(
        "missing-deployment-name",
        weightsync().set("spec.inference.0.deploymentRef", {}).build(),
        "spec.inference[0].deploymentRef.name",
        "Required value",
    ),
    Invalid(
        "missing-port",
        weightsync().delete("spec.inference.0.port").build(),
        "spec.inference[0].port",
        "Required value",
    ),
    Invalid(
        "deployment-name-not-dns",
        weightsync().set("spec.inference.0.deploymentRef.name", "Rollout_A").build(),
        "spec.inference[0].deploymentRef.name",
        "should match",
    ),
    Invalid(
        "duplicate-inference-references",
        weightsync().inference("engine-a", engine="VLLM", port=8001).build(),
        "spec.inference",
        INFERENCE_UNIQUE.message,
        rule=INFERENCE_UNIQUE,
    ),
    Invalid(
        "no-inference",
        weightsync().set("spec.inference", []).build(),
        "spec.inference",
        "should have at least 1 items",
    ),
    Invalid(
        "too-many-inference-entries",
        _many_engines(17),
        "spec.inference",
        "must have at most 16 items",
    ),
    Invalid(
        "port-zero",
        weightsync().set("spec.inference.0.port", 0).build(),
        "spec.inference[0].port",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "port-above-65535",
        weightsync().set("spec.inference.0.port", 70000).build(),
        "spec.inference[0].port",
        "should be less than or equal to 65535",
    ),
    Invalid(
        "negative-source-rank",
        weightsync().set("spec.trainer.sourceRanks", [-1]).build(),
        "spec.trainer.sourceRanks",
        SOURCE_RANKS_FORM.message,
        rule=SOURCE_RANKS_FORM,
    ),
    Invalid(
        "source-ranks-all-and-more",
        weightsync().set("spec.trainer.sourceRanks", ["all", 1]).build(),
        "spec.trainer.sourceRanks",
        SOURCE_RANKS_FORM.message,
        rule=SOURCE_RANKS_FORM,
    ),
    Invalid(
        "source-rank-a-word",
        weightsync().set("spec.trainer.sourceRanks", ["three"]).build(),
        "spec.trainer.sourceRanks",
        SOURCE_RANKS_FORM.message,
        rule=SOURCE_RANKS_FORM,
    ),
    Invalid(
        "colocated-all-ranks-without-ranks-per-pod",
        weightsync().set("spec.mode", "Colocated").set("spec.trainer.sourceRanks", ["all"]).build(),
        "spec.trainer.sourceRanks",
        COLOCATED_ONE_SOURCE.message,
        rule=COLOCATED_ONE_SOURCE,
    ),
    Invalid(
        "colocated-ranks-of-two-pods",
        weightsync()
        .set("spec.mode", "Colocated")
        .set("spec.trainer.ranksPerPod", 2)
        .set("spec.trainer.sourceRanks", [1, 2])
        .build(),
        "spec.trainer.sourceRanks",
        COLOCATED_ONE_SOURCE.message,
        rule=COLOCATED_ONE_SOURCE,
    ),
    Invalid(
        "colocated-part-of-a-pods-ranks",
        weightsync()
        .set("spec.mode", "Colocated")
        .set("spec.trainer.ranksPerPod", 4)
        .set("spec.trainer.sourceRanks", [0, 1])
        .build(),
        "spec.trainer.sourceRanks",
        COLOCATED_ONE_SOURCE.message,
        rule=COLOCATED_ONE_SOURCE,
    ),
    Invalid(
        "zero-ranks-per-pod",
        weightsync().set("spec.trainer.ranksPerPod", 0).build(),
        "spec.trainer.ranksPerPod",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "duplicate-source-ranks",
        weightsync().set("spec.trainer.sourceRanks", [0, 1, 0]).build(),
        "spec.trainer.sourceRanks[2]",
        "Duplicate value: 0",
    ),
    Invalid(
        "colocated-several-source-ranks-without-ranks-per-pod",
        weightsync().set("spec.mode", "Colocated").set("spec.trainer.sourceRanks", [0, 1]).build(),
        "spec.trainer.sourceRanks",
        COLOCATED_ONE_SOURCE.message,
        rule=COLOCATED_ONE_SOURCE,
    ),
    Invalid(
        "no-source-ranks",
        weightsync().set("spec.trainer.sourceRanks", []).build(),
        "spec.trainer.sourceRanks",
        "should have at least 1 items",
    ),
    Invalid(
        "sglang-cannot-wait",
        weightsync()
        .set("spec.inference.0.engine", "SGLang")
        .set("spec.inference.0.pauseMode", "Wait")
        .build(),
        "spec.inference[0].pauseMode",
        SGLANG_CANNOT_WAIT.message,
        rule=SGLANG_CANNOT_WAIT,
    ),
    Invalid(
        "front-on-the-engine-port",
        weightsync().set("spec.inference.0.front", {"port": 8000}).build(),
        "spec.inference[0].front.port",
        FRONT_NOT_ENGINE_PORT.message,
        rule=FRONT_NOT_ENGINE_PORT,
    ),
    Invalid(
        "front-port-zero",
        weightsync().set("spec.inference.0.front", {"port": 0}).build(),
        "spec.inference[0].front.port",
        "should be greater than or equal to 1",
    ),
    Invalid(
        "front-without-port",
        weightsync().set("spec.inference.0.front", {}).build(),
        "spec.inference[0].front.port",
        "Required value",
    ),
    Invalid(
        "colocated-with-a-front",
        weightsync()
        .set("spec.mode", "Colocated")
        .set("spec.inference.0.front", {"port": 8001})
        .build(),
        "spec.inference",
        COLOCATED_NO_FRONT.message,
        rule=COLOCATED_NO_FRONT,
    ),
    Invalid(
        "memory-release-when-disaggregated",
        weightsync().set("spec.colocated", {"memoryRelease": "KVCache"}).build(),
        "spec.colocated",
        COLOCATED_ONLY.message,
        rule=COLOCATED_ONLY,
    ),
    Invalid(
        "memory-release-unknown",
        weightsync()
        .set("spec.mode", "Colocated")
        .set("spec.colocated", {"memoryRelease": "Everything"})
        .build(),
        "spec.colocated.memoryRelease",
        'Unsupported value: "Everything"',
    ),
    Invalid(
        "colocated-with-two-engines",
        weightsync().set("spec.mode", "Colocated").inference("engine-b").build(),
        "spec.inference",
        COLOCATED_ONE_INFERENCE.message,
        rule=COLOCATED_ONE_INFERENCE,
    ),
    Invalid(
        "unknown-transfer-field",
        weightsync().set("spec.transfer.bucketSize", 1024).build(),
        "spec.transfer.bucketSize",
        'unknown field "spec.transfer.bucketSize"',
        unknown_field=True,
    ),
    Invalid(
        "unknown-spec-field",
        weightsync().set("spec.replicas", 2).build(),
        "spec.replicas",
        'unknown field "spec.replicas"',
        unknown_field=True,
    ),
    Invalid(
        "agent-env-of-the-operator",
        weightsync()
        .set("spec.agent", {"env": [{"name": "WEIGHTSYNC_DEVICE", "value": "cuda:3"}]})
        .build(),
        "spec.agent.env[0].name",
        "names starting with WEIGHTSYNC_",
        rule=ENV_NOT_RESERVED,
    ),
    Invalid(
        "agent-gpu-of-its-own",
        weightsync().set("spec.agent", {"resources": {"limits": {"nvidia.com/gpu": "1"}}}).build(),
        "spec.agent.resources.limits",
        "the sidecar asks for no GPU of its own",
        rule=NO_GPU_OF_ITS_OWN,
    ),
]


@dataclass(frozen=True)
class InvalidUpdate:
    id: str
    before: dict[str, Any]
    after: dict[str, Any]
    path: str
    rule: CelRule


UPDATE_CASES = [
    InvalidUpdate(
        "mode-changed",
        weightsync().build(),
        weightsync().set("spec.mode", "Colocated").build(),
        "spec.mode",
        MODE_IMMUTABLE,
    ),
    InvalidUpdate(
        "trainer-changed",
        weightsync().build(),
        weightsync().set("spec.trainer.statefulSetRef.name", "other-trainer").build(),
        "spec.trainer.statefulSetRef.name",
        TRAINER_IMMUTABLE,
    ),
    InvalidUpdate(
        "jobset-trainer-changed",
        weightsync()
        .delete("spec.trainer.statefulSetRef")
        .set("spec.trainer.jobSetRef", {"name": "a"})
        .build(),
        weightsync()
        .delete("spec.trainer.statefulSetRef")
        .set("spec.trainer.jobSetRef", {"name": "b"})
        .build(),
        "spec.trainer.jobSetRef.name",
        JOBSET_IMMUTABLE,
    ),
    InvalidUpdate(
        "trainer-kind-changed",
        weightsync().build(),
        weightsync()
        .delete("spec.trainer.statefulSetRef")
        .set("spec.trainer.jobSetRef", {"name": "trainer"})
        .build(),
        "spec.trainer",
        TRAINER_KIND_IMMUTABLE,
    ),
]


def condition(type_: str = "Ready", **overrides: Any) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True",
        "observedGeneration": 1,
        "lastTransitionTime": "2026-01-02T03:04:05Z",
        "reason": "AllMembersCurrent",
        "message": "All 2 sink ranks serve version 7.",
        **overrides,
    }


def last_round(**overrides: Any) -> dict[str, Any]:
    return {
        "version": 7,
        "completionTime": "2026-01-02T03:04:05Z",
        "durationMillis": 48,
        "bytes": 16_060_000_000,
        "bandwidthBytesPerSecond": 334_583_333_333,
        **overrides,
    }


@dataclass(frozen=True)
class InvalidStatus:
    id: str
    status: dict[str, Any]
    path: str
    server_says: str
    unknown_field: bool = field(default=False)


STATUS_CASES = [
    InvalidStatus(
        "duplicate-condition-type",
        {"conditions": [condition(), condition(status="False")]},
        "status.conditions[1]",
        "Duplicate value",
    ),
    InvalidStatus(
        "condition-status-not-true-false-unknown",
        {"conditions": [condition(status="Maybe")]},
        "status.conditions[0].status",
        'Unsupported value: "Maybe"',
    ),
    InvalidStatus(
        "condition-reason-with-spaces",
        {"conditions": [condition(reason="all good")]},
        "status.conditions[0].reason",
        "should match",
    ),
    InvalidStatus(
        "fractional-bandwidth",
        {"lastRound": last_round(bandwidthBytesPerSecond=1.5)},
        "status.lastRound.bandwidthBytesPerSecond",
        "must be of type integer",
    ),
    InvalidStatus(
        "status-phase",
        {"phase": "Running"},
        "status.phase",
        'unknown field "status.phase"',
        unknown_field=True,
    ),
]

# Caught by the models alone: `status.members` is an atomic list, so the API server no
# longer checks its ranks are unique (as a map keyed by rank it tracked every member's
# fields, and a 1,001-member status write cost it 2.5x). Only the operator writes it,
# through the models.
MODEL_STATUS_CASES = [
    InvalidStatus(
        "duplicate-member-rank",
        {
            "members": [
                {"pod": "trainer-0", "role": "Source", "rank": 0, "warm": True},
                {"pod": "engine-a-x", "role": "Sink", "rank": 0, "warm": True},
            ]
        },
        "status.members[1]",
        "",
    ),
]
