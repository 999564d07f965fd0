"""GPUs by allocation on the real node: each sidecar gets exactly its engine's devices.

The node's DRA driver (`fake-gpu-dra`, node/realnode.py) publishes four fake GPUs; an
engine Deployment's pods each claim one through a ResourceClaimTemplate. The scheduler
allocates, the kubelet prepares each claim through the driver, and containerd applies
the driver's CDI spec to every container naming the claim: the engine container, and
the agent sidecar, which the webhook gave the same claim. So each pod's two containers
see the same device, and the two pods different ones. These GPUs have no CUDA behind
them: the agent, told to use its first GPU (`cuda:0`), finds none and exits saying
why, which is what it must do wherever its claim did not give it a usable GPU.

Colocated: the trainer pod and the engine pod name one ResourceClaim, which DRA lets
several pods use, so both pods' containers and the sidecar see the one same device.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.cluster.node.realnode import GPU_DRIVER
from tests.support.eventually import eventually
from tests.support.operator import (
    PODS_UP,
    OperatorProcess,
    apply,
    engines,
    pods,
    trainer,
    weightsync,
)
from weightsync.controller import names

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ONE_GPU = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaimTemplate",
    "metadata": {"name": "one-gpu"},
    "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER, "count": 1}}
    ]}}},
}  # fmt: skip

SHARED_GPU = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "shared-gpu"},
    "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER, "count": 1}}
    ]}},
}  # fmt: skip


def _gpus(cluster: LocalCluster, container_id: str) -> list[str]:
    """The FAKE_GPU_* variables containerd gave a container (its OCI spec, which outlives
    the process of a container that exited)."""
    info = json.loads(cluster.node.ctr("containers", "info", container_id))
    env = info["Spec"]["process"]["env"]
    return sorted(e for e in env if e.startswith("FAKE_GPU_"))


def _containers(cluster: LocalCluster, pod: dict[str, Any]) -> dict[str, str]:
    """The latest container id of each of `pod`'s containers, by name."""
    meta = pod["metadata"]
    found: dict[str, tuple[int, str]] = {}
    for c in cluster.node.containers():  # names repeat across the tests' namespaces
        if (c["namespace"], c["pod"]) == (meta["namespace"], meta["name"]):
            attempt = int(str(c["attempt"]))
            if attempt >= found.get(str(c["container"]), (-1, ""))[0]:
                found[str(c["container"])] = (attempt, str(c["id"]))
    return {container: id_ for container, (_, id_) in found.items()}


def test_each_sidecar_sees_exactly_its_engines_claimed_gpu(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    deployment = engines(replicas=2)
    spec = deployment["spec"]["template"]["spec"]
    spec["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "one-gpu"}]
    spec["containers"][0]["resources"] = {"claims": [{"name": "gpus"}]}
    apply(cluster, namespace, ONE_GPU, weightsync(), trainer(), deployment)

    def both_started() -> list[dict[str, Any]] | None:
        listed = pods(cluster, namespace, "engine")
        ids = [_containers(cluster, p) for p in listed]
        started = len(listed) == 2 and all({"engine", names.AGENT_CONTAINER} <= set(i) for i in ids)
        return listed if started else None

    listed = eventually(both_started, timeout=PODS_UP, message="engines and sidecars started")
    seen = []
    for pod in listed:
        agent = next(c for c in pod["spec"]["initContainers"] if c["name"] == names.AGENT_CONTAINER)
        assert agent["resources"]["claims"] == [{"name": "gpus"}]  # shared by the webhook
        assert pod["metadata"]["annotations"][names.AGENT_DEVICE_ANNOTATION] == "cuda:0"
        ids = _containers(cluster, pod)
        engine_gpus = _gpus(cluster, ids["engine"])
        assert len(engine_gpus) == 1, engine_gpus  # its claim's device, not the node's four
        assert _gpus(cluster, ids[names.AGENT_CONTAINER]) == engine_gpus
        seen.extend(engine_gpus)
    assert len(set(seen)) == 2, seen  # two pods, two devices

    def refused_in_status() -> str | None:
        for pod in pods(cluster, namespace, "engine"):
            for status in pod["status"].get("initContainerStatuses") or []:
                last = (status.get("lastState") or {}).get("terminated") or {}
                if status["name"] == names.AGENT_CONTAINER and last.get("exitCode") == 2:
                    return str(last.get("message") or "")
        return None

    message = eventually(refused_in_status, timeout=PODS_UP, message="the agent's reason")
    assert "cuda:0: not visible in this container, which sees 0 GPU(s)" in message


def _name_claim(workload: dict[str, Any], claim: dict[str, str]) -> dict[str, Any]:
    spec = workload["spec"]["template"]["spec"]
    spec["resourceClaims"] = [{"name": "gpu", **claim}]
    spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return workload


def test_a_colocated_trainer_and_engine_share_one_claims_gpu(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    """docs/examples/colocated-shared-claim on the real node: one claim, both pods."""
    shared = {"resourceClaimName": "shared-gpu"}
    sync = weightsync()
    sync["spec"]["mode"] = "Colocated"
    sync["spec"]["trainer"]["sourceRanks"] = [0]
    apply(
        cluster, namespace, SHARED_GPU, sync,
        _name_claim(trainer(), shared), _name_claim(engines(replicas=1), shared),
    )  # fmt: skip

    def started() -> dict[str, dict[str, str]] | None:
        ids = {
            role: _containers(cluster, p)
            for role in ("trainer", "engine")
            for p in pods(cluster, namespace, role)
        }
        want = {"trainer": {"trainer", names.AGENT_CONTAINER}, "engine": {"engine"}}
        done = all(want[role] <= set(ids.get(role, {})) for role in want)
        return ids if done else None

    ids = eventually(started, timeout=PODS_UP, message="both pods' containers started")
    seen = {
        f"{role}/{container}": _gpus(cluster, id_)
        for role, by_name in ids.items()
        for container, id_ in by_name.items()
    }
    gpu = seen["trainer/trainer"]
    assert len(gpu) == 1, seen  # the claim's one device, not the node's four
    assert all(devices == gpu for devices in seen.values()), seen  # every container: that one
    (trainer_pod,) = pods(cluster, namespace, "trainer")
    agent = next(
        c for c in trainer_pod["spec"]["initContainers"] if c["name"] == names.AGENT_CONTAINER
    )
    assert agent["resources"]["claims"] == [{"name": "gpu"}]  # shared by the webhook
    claim = json.loads(cluster.kubectl("get", "resourceclaim", "shared-gpu", "-n", namespace,
                                       "-o", "json").stdout)  # fmt: skip
    users = sorted(r["name"] for r in claim["status"].get("reservedFor") or [])
    assert len(users) == 2, users  # one allocation, reserved for both pods
