"""The v1alpha1 models: defaults, round trips, examples, and agreement with the CRD."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.api.builders import weightsync
from weightsync.api import API_VERSION, GROUP, VERSION, parse_weightsync
from weightsync.api.crd import openapi_schema
from weightsync.api.v1alpha1 import (
    Engine,
    EngineKind,
    Member,
    PauseMode,
    RecoveryProtocol,
    Role,
    RoundSummary,
    SyncMode,
    TrainerKind,
    WeightSyncStatus,
)

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "docs" / "examples").glob("*.yaml"))


def apply_schema_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """What the API server's structural defaulting does to `value`: fill absent
    properties from `default`, top down, so a `{}` default gets its fields' defaults."""
    if isinstance(value, dict):
        result = dict(value)
        for name, child in schema.get("properties", {}).items():
            if name not in result and "default" in child:
                result[name] = copy.deepcopy(child["default"])
            if name in result:
                result[name] = apply_schema_defaults(result[name], child)
        return result
    if isinstance(value, list) and "items" in schema:
        return [apply_schema_defaults(item, schema["items"]) for item in value]
    return value


def test_api_version_is_group_and_version() -> None:
    assert f"{GROUP}/{VERSION}" == API_VERSION


def test_spec_defaults() -> None:
    spec = parse_weightsync(weightsync().build()).spec
    assert spec.trainer.source_ranks == [0]
    assert spec.mode is SyncMode.DISAGGREGATED
    assert spec.transfer.bucket_size_bytes == 1024 * 1024 * 1024
    assert spec.transfer.pipeline_depth == 2
    assert spec.transfer.timeout_seconds == 60
    assert spec.transfer.checksum is False
    assert (spec.prewarm.enabled, spec.prewarm.timeout_seconds) == (True, 120)
    assert spec.recovery.enabled is True
    assert spec.recovery.protocol is RecoveryProtocol.AUTO
    assert spec.recovery.holders == 1
    assert spec.readiness_gate.enabled is True
    entry = spec.inference[0]
    assert (entry.engine, entry.pause_mode, entry.flush_cache) == (
        Engine.REFERENCE,
        PauseMode.ABORT,
        True,
    )


def test_crd_defaults_equal_model_defaults() -> None:
    # The API server applies the CRD's defaults; the operator applies the models'.
    # They must agree, or the operator would act on a spec the user never saw.
    manifest = weightsync().build()
    server_defaulted = apply_schema_defaults(manifest, openapi_schema())
    assert server_defaulted["spec"] == parse_weightsync(manifest).spec.to_k8s()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_crd_defaults_equal_model_defaults_for_each_example(example: Path) -> None:
    manifest = yaml.safe_load(example.read_text())
    server_defaulted = apply_schema_defaults(manifest, openapi_schema())
    assert server_defaulted["spec"] == parse_weightsync(manifest).spec.to_k8s()


def test_examples_exist() -> None:
    names = {path.name for path in EXAMPLES}
    assert {
        "weightsync-minimal.yaml",
        "weightsync-sglang-vllm.yaml",
        "weightsync-colocated.yaml",
    } <= names


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_example_is_valid(example: Path) -> None:
    documents = list(yaml.safe_load_all(example.read_text()))
    assert len(documents) == 1
    sync = parse_weightsync(documents[0])
    assert sync.metadata.name
    assert sync.metadata.namespace is None, "examples apply into any namespace"


def test_colocated_example_is_colocated() -> None:
    manifest = yaml.safe_load(
        next(path for path in EXAMPLES if path.name == "weightsync-colocated.yaml").read_text()
    )
    assert parse_weightsync(manifest).spec.mode is SyncMode.COLOCATED


def test_spec_round_trips_through_json() -> None:
    manifest = weightsync().inference("engine-b", engine="VLLM", port=8001).build()
    sync = parse_weightsync(manifest)
    assert parse_weightsync(sync.to_k8s()) == sync


def test_python_names_and_json_names_both_construct() -> None:
    by_alias = RoundSummary.model_validate(
        {
            "version": 1,
            "completionTime": "2026-01-02T03:04:05Z",
            "durationMillis": 10,
            "bytes": 100,
            "bandwidthBytesPerSecond": 10_000,
        }
    )
    by_name = RoundSummary(
        version=1,
        completion_time=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        duration_millis=10,
        bytes=100,
        bandwidth_bytes_per_second=10_000,
    )
    assert by_alias == by_name
    assert by_name.to_k8s()["completionTime"] == "2026-01-02T03:04:05Z"


def test_status_serialises_without_unset_fields() -> None:
    status = WeightSyncStatus(
        members=[Member(pod="trainer-0", role=Role.SOURCE, rank=0, warm=False)],
        member_count=1,
    )
    assert status.to_k8s() == {
        "conditions": [],
        "memberCount": 1,
        "members": [{"pod": "trainer-0", "role": "Source", "rank": 0, "warm": False}],
    }


def test_timestamps_must_carry_a_timezone() -> None:
    with pytest.raises(ValueError, match="timezone"):
        RoundSummary(
            version=1,
            completion_time=datetime(2026, 1, 2, 3, 4, 5),
            duration_millis=1,
            bytes=1,
            bandwidth_bytes_per_second=1,
        )


def test_models_are_immutable() -> None:
    sync = parse_weightsync(weightsync().build())
    with pytest.raises(ValueError, match="frozen"):
        sync.spec.transfer.pipeline_depth = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("spec.inference.0.port", 8000.0),
        ("spec.inference.0.port", True),
        ("spec.readinessGate.enabled", 1),
        ("spec.prewarm.enabled", "true"),
    ],
)
def test_integers_and_booleans_are_not_coerced(path: str, value: Any) -> None:
    # The API server rejects these types; so must the backstop.
    with pytest.raises(ValueError, match="valid"):
        parse_weightsync(weightsync().set(path, value).build())


def test_a_weightsync_of_a_jobset_trainer_and_leaderworkerset_engines_parses() -> None:
    sync = parse_weightsync(
        weightsync()
        .delete("spec.trainer.statefulSetRef")
        .set("spec.trainer.jobSetRef", {"name": "train"})
        .delete("spec.inference.0.deploymentRef")
        .set("spec.inference.0.leaderWorkerSetRef", {"name": "vllm"})
        .inference("small")
        .build()
    )
    assert (sync.spec.trainer.kind, sync.spec.trainer.name) == (TrainerKind.JOB_SET, "train")
    assert [(e.kind, e.name) for e in sync.spec.inference] == [
        (EngineKind.LEADER_WORKER_SET, "vllm"),
        (EngineKind.DEPLOYMENT, "small"),
    ]


def test_a_weightsync_written_before_the_other_kinds_binds_what_it_always_did() -> None:
    sync = parse_weightsync(weightsync().build())
    assert (sync.spec.trainer.kind, sync.spec.trainer.name) == (TrainerKind.STATEFUL_SET, "trainer")
    assert (sync.spec.inference[0].kind, sync.spec.inference[0].name) == (
        EngineKind.DEPLOYMENT,
        "engine-a",
    )


def test_an_indexed_job_trainer_parses() -> None:
    sync = parse_weightsync(
        weightsync()
        .delete("spec.trainer.statefulSetRef")
        .set("spec.trainer.jobRef", {"name": "train"})
        .build()
    )
    assert (sync.spec.trainer.kind, sync.spec.trainer.name) == (TrainerKind.JOB, "train")
