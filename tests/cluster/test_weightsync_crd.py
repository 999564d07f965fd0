"""The generated WeightSync CRD against a real kube-apiserver.

The CRD installs and is structural; every docs/examples manifest is accepted as
is; invalid WeightSyncs (the same cases the Python backstop is tested with) are
rejected with the offending field path; immutable fields stay immutable; the
status the operator writes through the models is accepted; and `kubectl get`
prints the printer columns.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.controlplane import LocalCluster
from tests.support.eventually import Timeouts, eventually
from tests.unit.api.builders import weightsync
from tests.unit.api.invalid_cases import (
    CREATE_CASES,
    STATUS_CASES,
    UPDATE_CASES,
    Invalid,
    InvalidStatus,
    InvalidUpdate,
    condition,
    last_round,
)
from weightsync.api import CRD_NAME, GROUP, PLURAL, VERSION, parse_weightsync
from weightsync.api.v1alpha1 import WeightSyncStatus

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = REPO_ROOT / "crds" / "weightsync.io_weightsyncs.yaml"
EXAMPLES = sorted((REPO_ROOT / "docs" / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd(cluster: LocalCluster) -> LocalCluster:
    """The cluster with the committed CRD installed and served."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    cluster.kubectl(
        "wait", "--for=condition=Established", f"crd/{CRD_NAME}", f"--timeout={Timeouts.API:.0f}s"
    )
    # Discovery can lag Established by a moment; `kubectl get` needs the short name.
    eventually(
        lambda: cluster.kubectl("get", "wsync", "-A", check=False).returncode == 0,
        timeout=Timeouts.API,
        message="kubectl get wsync resolves",
    )
    # The CRD stays installed: later modules of the session may rely on it, and
    # re-applying the same file is a no-op.
    return cluster


@pytest.fixture(scope="module")
def rejection_namespace(crd: LocalCluster) -> Iterator[str]:
    """One namespace for the rejection cases: a rejected create leaves nothing behind."""
    name = f"wsync-invalid-{secrets.token_hex(3)}"
    crd.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        crd.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _create(
    cluster: LocalCluster, namespace: str, manifest: dict[str, Any], *extra: str
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "create",
        "--validate=strict",
        "-n",
        namespace,
        "-f",
        "-",
        *extra,
        input=yaml.safe_dump(manifest),
        check=False,
    )


def _get(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", "wsync", name, "-n", namespace, "-o", "json")
    obj: dict[str, Any] = json.loads(result.stdout)
    return obj


def _patch_status(
    k8s: client.ApiClient, namespace: str, name: str, status: dict[str, Any]
) -> dict[str, Any]:
    result = client.CustomObjectsApi(k8s).patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"status": status},
        field_validation="Strict",
    )
    assert isinstance(result, dict)
    return result


def test_crd_is_established_and_structural(crd: LocalCluster) -> None:
    obj = json.loads(crd.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert "NonStructuralSchema" not in conditions
    assert obj["status"]["acceptedNames"]["shortNames"] == ["wsync"]


def test_kubectl_explain_shows_the_field_docs(crd: LocalCluster) -> None:
    # Descriptions reach users through the published OpenAPI; discovery may lag.
    def explain() -> str:
        return crd.kubectl("explain", "weightsync.spec.transfer.bucketSizeBytes").stdout

    text = eventually(explain, timeout=Timeouts.API, message="kubectl explain weightsync")
    assert "bucketSizeBytes is the size of one broadcast bucket" in " ".join(text.split())


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_example_is_accepted_and_defaulted_like_the_models(
    crd: LocalCluster, namespace: str, example: Path
) -> None:
    manifest = yaml.safe_load(example.read_text())
    crd.kubectl("apply", "--validate=strict", "-n", namespace, "-f", str(example))

    stored = _get(crd, namespace, manifest["metadata"]["name"])

    # The API server's defaults and the models' defaults must be the same spec.
    assert stored["spec"] == parse_weightsync(manifest).spec.to_k8s()
    assert parse_weightsync(stored).metadata.generation == 1


def test_all_examples_apply_together(crd: LocalCluster, namespace: str) -> None:
    crd.kubectl("apply", "--server-side", "-n", namespace, "-f", str(REPO_ROOT / "docs/examples"))
    listed = json.loads(crd.kubectl("get", "wsync", "-n", namespace, "-o", "json").stdout)
    names = sorted(item["metadata"]["name"] for item in listed["items"])
    assert names == sorted(
        yaml.safe_load(path.read_text())["metadata"]["name"] for path in EXAMPLES
    )


WALKTHROUGHS = {
    "vllm-tp": ["vllm-tp/gpus.yaml", "vllm-tp/trainer.yaml", "vllm-tp/engine.yaml",
                "vllm-tp/weightsync.yaml"],
    "colocated-shared-claim": ["colocated-shared-claim/gpu.yaml",
                               "colocated-shared-claim/trainer.yaml",
                               "colocated-shared-claim/engine.yaml", "weightsync-colocated.yaml"],
}  # fmt: skip


@pytest.mark.parametrize("files", WALKTHROUGHS.values(), ids=WALKTHROUGHS.keys())
def test_the_walkthrough_manifests_are_accepted_as_they_are(
    crd: LocalCluster, namespace: str, files: list[str]
) -> None:
    """docs/real-cluster.md's walkthrough (claims, trainer, vLLM engine, WeightSync) and
    the Colocated example of one claim shared by two pods, each file as a user applies it
    (a server-side dry run: nothing is scheduled)."""
    for name in files:
        applied = crd.kubectl(
            "apply", "--dry-run=server", "--validate=strict", "-n", namespace,
            "-f", str(REPO_ROOT / "docs" / "examples" / name),
        )  # fmt: skip
        assert "(server dry run)" in applied.stdout, applied.stdout


@pytest.mark.parametrize("case", CREATE_CASES, ids=lambda case: case.id)
def test_invalid_weightsync_is_rejected_with_its_field_path(
    crd: LocalCluster, rejection_namespace: str, case: Invalid
) -> None:
    manifest = dict(case.manifest, metadata={"name": case.id})
    result = _create(crd, rejection_namespace, manifest)

    assert result.returncode != 0, f"{case.id} was accepted"
    error = result.stderr
    if case.unknown_field:
        assert f'unknown field "{case.path}"' in error
    else:
        assert f"{case.path}: " in error, error
    assert case.server_says in error, error
    if case.rule is not None:
        # The API server and the Python backstop print the same rule message.
        assert f"{case.path}: Invalid value: " in error
        assert case.rule.message in error


def test_unknown_fields_are_pruned_when_validation_is_off(
    crd: LocalCluster, namespace: str
) -> None:
    manifest = weightsync("pruned").set("spec.transfer.bucketSize", 1024).build()
    result = _create(crd, namespace, manifest, "--validate=false")
    assert result.returncode == 0, result.stderr
    stored = _get(crd, namespace, "pruned")
    assert "bucketSize" not in stored["spec"]["transfer"]
    parse_weightsync(stored)


@pytest.mark.parametrize("case", UPDATE_CASES, ids=lambda case: case.id)
def test_immutable_field_cannot_change(
    crd: LocalCluster, namespace: str, case: InvalidUpdate
) -> None:
    crd.kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(case.before))

    result = crd.kubectl(
        "replace", "-n", namespace, "-f", "-", input=yaml.safe_dump(case.after), check=False
    )

    assert result.returncode != 0, f"{case.id}: the change was accepted"
    assert f"{case.path}: Forbidden: {case.rule.message}" in result.stderr, result.stderr
    stored = _get(crd, namespace, case.before["metadata"]["name"])
    assert stored["spec"] == parse_weightsync(case.before).spec.to_k8s()


def test_mutable_fields_can_change(crd: LocalCluster, namespace: str) -> None:
    crd.kubectl("create", "-n", namespace, "-f", "-", input=weightsync().yaml())
    changed = (
        weightsync()
        .set("spec.transfer.pipelineDepth", 4)
        .set("spec.recovery.protocol", "TCP")
        .inference("engine-b", engine="VLLM", port=8001)
        .yaml()
    )
    crd.kubectl("replace", "--validate=strict", "-n", namespace, "-f", "-", input=changed)
    stored = _get(crd, namespace, "sync")
    assert stored["spec"]["transfer"]["pipelineDepth"] == 4
    assert [i["deploymentRef"]["name"] for i in stored["spec"]["inference"]] == [
        "engine-a",
        "engine-b",
    ]
    assert stored["metadata"]["generation"] == 2


@pytest.mark.parametrize("case", STATUS_CASES, ids=lambda case: case.id)
def test_invalid_status_is_rejected_with_its_field_path(
    crd: LocalCluster, k8s: client.ApiClient, namespace: str, case: InvalidStatus
) -> None:
    crd.kubectl("create", "-n", namespace, "-f", "-", input=weightsync().yaml())

    with pytest.raises(ApiException) as raised:
        _patch_status(k8s, namespace, "sync", case.status)

    message = json.loads(str(raised.value.body))["message"]
    if case.unknown_field:
        assert f'unknown field "{case.path}"' in message
    else:
        assert f"{case.path}: " in message, message
    assert case.server_says in message, message


def _status() -> dict[str, Any]:
    """A status as the operator writes it: built by the models, serialised by them."""
    members = [
        {"pod": "trainer-0", "role": "Source", "rank": 0, "node": "node-0", "version": 7},
        {"pod": "engine-a-1", "role": "Sink", "rank": 1, "node": "node-1", "version": 7},
        {"pod": "engine-a-2", "role": "Sink", "rank": 2, "node": "node-1", "version": 7},
    ]
    status = WeightSyncStatus.model_validate(
        {
            "conditions": [
                condition(),
                condition("Prewarmed", reason="GroupWarm", message=""),
                condition("Syncing", status="False", reason="Idle", message=""),
                condition("Degraded", status="False", reason="AsExpected", message=""),
            ],
            "observedGeneration": 1,
            "currentVersion": 7,
            "groupGeneration": 4,
            "memberCount": 3,
            "members": [dict(member, warm=True) for member in members],
            "lastRound": last_round(),
        }
    )
    return status.to_k8s()


def test_status_written_through_the_models_is_stored_as_is(
    crd: LocalCluster, k8s: client.ApiClient, namespace: str
) -> None:
    crd.kubectl("create", "-n", namespace, "-f", "-", input=weightsync().yaml())
    status = _status()

    stored = _patch_status(k8s, namespace, "sync", status)

    assert stored["status"] == status
    assert parse_weightsync(stored).status.to_k8s() == status


def test_status_is_a_subresource(crd: LocalCluster, namespace: str) -> None:
    # A spec update that carries a status must not change the status.
    manifest = weightsync().build()
    manifest["status"] = {"currentVersion": 99}
    crd.kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
    assert "currentVersion" not in _get(crd, namespace, "sync").get("status", {})


def _table(output: str) -> list[list[str]]:
    return [line.split() for line in output.strip().splitlines()]


def test_kubectl_get_prints_the_printer_columns(
    crd: LocalCluster, k8s: client.ApiClient, namespace: str
) -> None:
    crd.kubectl("create", "-n", namespace, "-f", "-", input=weightsync("tiny").yaml())
    _patch_status(k8s, namespace, "tiny", _status())

    header, row = _table(crd.kubectl("get", "wsync", "-n", namespace).stdout)
    assert header == ["NAME", "READY", "VERSION", "MEMBERS", "LAST-SYNC", "AGE"]
    assert row[:4] == ["tiny", "True", "7", "3"]

    header, row = _table(crd.kubectl("get", "wsync", "-n", namespace, "-o", "wide").stdout)
    assert header == [
        "NAME",
        "READY",
        "VERSION",
        "MEMBERS",
        "LAST-SYNC",
        "AGE",
        "MODE",
        "GROUP-GENERATION",
        "ROUND-MILLIS",
        "REASON",
    ]
    assert row[0] == "tiny"
    assert row[-4:] == ["Disaggregated", "4", "48", "AllMembersCurrent"]


def test_kubectl_get_before_any_status(crd: LocalCluster, namespace: str) -> None:
    crd.kubectl("create", "-n", namespace, "-f", "-", input=weightsync("fresh").yaml())
    header, row = _table(crd.kubectl("get", "weightsyncs", "-n", namespace).stdout)
    assert header == ["NAME", "READY", "VERSION", "MEMBERS", "LAST-SYNC", "AGE"]
    # Status columns of an object the operator has not seen yet are blank, not errors:
    # only the name and the age are printed.
    assert len(row) == 2
    assert row[0] == "fresh"
    assert re.fullmatch(r"\d+s", row[1]), row
