"""The Python backstop: parse_weightsync and check_update."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from tests.unit.api.builders import weightsync
from tests.unit.api.invalid_cases import (
    CREATE_CASES,
    MODEL_STATUS_CASES,
    STATUS_CASES,
    UPDATE_CASES,
    Invalid,
    InvalidStatus,
    InvalidUpdate,
)
from weightsync.api import (
    FieldError,
    WeightSyncInvalidError,
    check_update,
    parse_weightsync,
)
from weightsync.api.cel import CelRule
from weightsync.api.crd import openapi_schema
from weightsync.api.v1alpha1 import agent as agent_module
from weightsync.api.v1alpha1 import front as front_module
from weightsync.api.v1alpha1 import spec as spec_module
from weightsync.api.validation import IMMUTABLE_FIELDS, field_path


def _errors(manifest: dict[str, Any]) -> tuple[FieldError, ...]:
    with pytest.raises(WeightSyncInvalidError) as raised:
        parse_weightsync(manifest)
    return raised.value.errors


@pytest.mark.parametrize("case", CREATE_CASES, ids=lambda case: case.id)
def test_invalid_spec_is_rejected_at_the_api_servers_path(case: Invalid) -> None:
    errors = _errors(case.manifest)
    assert [error.path for error in errors] == [case.path], errors
    if case.rule is not None:
        assert errors[0].message == case.rule.message


@pytest.mark.parametrize("case", STATUS_CASES + MODEL_STATUS_CASES, ids=lambda case: case.id)
def test_invalid_status_is_rejected_at_the_api_servers_path(case: InvalidStatus) -> None:
    manifest = weightsync().build()
    manifest["status"] = case.status
    errors = _errors(manifest)
    assert [error.path for error in errors] == [case.path], errors


def test_every_cel_rule_has_a_case() -> None:
    rules = {
        value
        for module in (spec_module, agent_module, front_module)
        for value in vars(module).values()
        if isinstance(value, CelRule)
    }
    covered = {case.rule for case in CREATE_CASES} | {case.rule for case in UPDATE_CASES}
    assert rules, "no CEL rules found"
    assert rules <= covered, rules - covered
    assert len({case.id for case in CREATE_CASES}) == len(CREATE_CASES)


def test_error_message_lists_every_problem() -> None:
    manifest = (
        weightsync()
        .set("spec.transfer.pipelineDepth", 9)
        .set("spec.inference.0.engine", "Triton")
        .build()
    )
    with pytest.raises(WeightSyncInvalidError) as raised:
        parse_weightsync(manifest)
    text = str(raised.value)
    assert "spec.inference[0].engine: Input should be 'SGLang', 'VLLM' or 'Reference'" in text
    assert "spec.transfer.pipelineDepth: Input should be less than or equal to 4" in text


def test_wrong_api_version_or_kind_is_rejected() -> None:
    manifest = weightsync().set("apiVersion", "weightsync.io/v1").set("kind", "Other").build()
    assert [error.path for error in _errors(manifest)] == ["apiVersion", "kind"]


def test_reads_read_only_mappings_as_kopf_hands_them_out() -> None:
    class ReadOnly(Mapping[str, Any]):
        def __init__(self, data: dict[str, Any]) -> None:
            self._data = data

        def __getitem__(self, key: str) -> Any:
            value = self._data[key]
            return ReadOnly(value) if isinstance(value, dict) else value

        def __iter__(self) -> Any:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

    sync = parse_weightsync(ReadOnly(weightsync("wrapped").build()))
    assert sync.metadata.name == "wrapped"
    assert sync.spec.inference[0].port == 8000


def test_metadata_fields_the_api_server_adds_are_ignored() -> None:
    manifest = weightsync().build()
    manifest["metadata"] |= {
        "namespace": "team-a",
        "generation": 3,
        "managedFields": [{"manager": "kubectl"}],
        "creationTimestamp": "2026-01-02T03:04:05Z",
    }
    sync = parse_weightsync(manifest)
    assert (sync.metadata.namespace, sync.metadata.generation) == ("team-a", 3)


@pytest.mark.parametrize("case", UPDATE_CASES, ids=lambda case: case.id)
def test_immutable_field_change_is_rejected(case: InvalidUpdate) -> None:
    before, after = parse_weightsync(case.before), parse_weightsync(case.after)
    with pytest.raises(WeightSyncInvalidError) as raised:
        check_update(before, after)
    assert raised.value.errors == (FieldError(case.path, case.rule.message),)


@pytest.mark.parametrize(
    ("ranks", "per_pod"), [([0], None), ([3], 2), ([0, 1], 2), ([2, 3], 2), (["all"], 4)]
)
def test_colocated_takes_one_rank_or_every_rank_of_one_pod(
    ranks: list[int | str], per_pod: int | None
) -> None:
    built = weightsync().set("spec.mode", "Colocated").set("spec.trainer.sourceRanks", ranks)
    if per_pod is not None:
        built = built.set("spec.trainer.ranksPerPod", per_pod)
    assert parse_weightsync(built.build()).spec.trainer.source_ranks == ranks


def test_mutable_fields_may_change() -> None:
    before = parse_weightsync(weightsync().build())
    after = parse_weightsync(
        weightsync()
        .set("spec.transfer.pipelineDepth", 4)
        .set("spec.recovery.protocol", "TCP")
        .inference("engine-b", engine="SGLang", port=30000)
        .build()
    )
    check_update(before, after)


def _transition_rule_paths(node: dict[str, Any], path: str = "") -> set[str]:
    found = set()
    for rule in node.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            found.add(path)
    for name, child in node.get("properties", {}).items():
        found |= _transition_rule_paths(child, f"{path}.{name}" if path else name)
    return found


def test_check_update_mirrors_every_transition_rule_of_the_crd() -> None:
    assert _transition_rule_paths(openapi_schema()) == {field.path for field in IMMUTABLE_FIELDS}


@pytest.mark.parametrize(
    ("location", "below", "expected"),
    [
        (("spec", "inference", 1, "port"), "", "spec.inference[1].port"),
        (("spec",), ".inference", "spec.inference"),
        (("spec", "trainer", "sourceRanks"), "[2]", "spec.trainer.sourceRanks[2]"),
        ((), ".inference", "inference"),
        ((), "", ""),
    ],
)
def test_field_path(location: tuple[int | str, ...], below: str, expected: str) -> None:
    assert field_path(location, below) == expected
