"""A trainer pod of two ranks on the real node: torchrun's two FSDP2 processes in one pod.

The WeightSync says `sourceRanks: [all]` and `ranksPerPod: 2`; the webhook gives the
pod one sidecar serving both ranks (an agent process each, its own socket and ports),
and the operator plans both as members (`trainer-0[0]`, `trainer-0[1]`) beside the
engine. Each rank publishes its own shards; the engine serves the trainer's full
weights bit for bit. When the sidecar container is killed, the kubelet restarts it in
place, the operator plans both ranks into a new generation, and the next step reaches
the engine again. In Colocated mode the same pod feeds an engine of two tensor-parallel
workers on its node, each loading its own copy.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.e2e.test_recovery import ROUND_UP, answers, no_tracebacks
from tests.support.eventually import eventually
from tests.support.operator import (
    ENGINE_IMAGE,
    ENGINE_PORT,
    POD_IP_ENV,
    PODS_UP,
    TRAINER_PORT,
    OperatorProcess,
    apply,
    engines,
    pods,
    ready,
    step,
    sync_status,
    template,
    trainer_digest,
    weightsync,
)
from tests.support.recovery import engine_digest, kill_container
from weightsync.controller import names

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

RANKS = ["trainer-0[0]", "trainer-0[1]"]


def two_rank_trainer() -> dict[str, Any]:
    container = {
        "name": "trainer",
        "image": ENGINE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["python", "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", "-m", "weightsync.reference.trainer",
                    "--host", "$(POD_IP)", "--port", str(TRAINER_PORT), "--interval", "0",
                    "--preset", "tiny"],
        "env": [POD_IP_ENV],
    }  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "trainer"},
        "spec": {
            "serviceName": "trainer",
            "replicas": 1,
            "selector": {"matchLabels": {"app": "trainer"}},
            "template": template("trainer", [container], inject=True, local=True),
        },
    }


def _warm_group(cluster: LocalCluster, namespace: str, count: int) -> tuple[int, list[str]]:
    """The planned generation once `count` members are warm, and those members."""

    def group() -> tuple[int | None, list[str]] | None:
        generation, warm = _members(cluster, namespace)
        return (generation, warm) if len(warm) == count else None

    generation, warm = eventually(group, timeout=PODS_UP, message=f"{count} members warm")
    assert generation is not None
    return generation, warm


def _two_steps_to_ready(cluster: LocalCluster, namespace: str, ip: str) -> dict[str, Any]:
    """Two trainer steps, each ok; then the engine pod, once Ready."""
    eventually(lambda: answers(f"http://{ip}:{TRAINER_PORT}/digest"), timeout=PODS_UP,
               message="trainer serving")  # fmt: skip
    for _ in range(2):
        result = step(ip)
        assert result["ok"], result
    (engine,) = eventually(lambda: ready(cluster, namespace, "engine", 1), timeout=ROUND_UP,
                           message="engine Ready")  # fmt: skip
    return engine


def _members(cluster: LocalCluster, namespace: str) -> tuple[int | None, list[str]]:
    status = sync_status(cluster, namespace)
    warm = [m["pod"] for m in status.get("members") or [] if m.get("warm")]
    return status.get("groupGeneration"), warm


def test_a_pod_of_two_ranks_publishes_from_both_and_survives_its_sidecar_restarting(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    sync = weightsync()
    sync["spec"]["trainer"].update(sourceRanks=["all"], ranksPerPod=2)
    apply(cluster, namespace, two_rank_trainer(), engines(replicas=1), sync)

    first, warm = _warm_group(cluster, namespace, 3)
    assert warm[:2] == RANKS  # trainer ranks first, in rank order
    (pod,) = pods(cluster, namespace, "trainer")
    annotations = pod["metadata"]["annotations"]
    assert annotations[names.AGENT_RANKS_ANNOTATION] == "0,1"
    ip = pod["status"]["podIP"]
    engine = _two_steps_to_ready(cluster, namespace, ip)
    assert engine_digest(engine, ENGINE_PORT) == trainer_digest(ip)

    # ---- the sidecar (both ranks' agents) is killed: restarted in place, planned anew
    kill_container(cluster.node, pod, names.AGENT_CONTAINER)

    def regrouped() -> bool:
        generation, warm = _members(cluster, namespace)
        return generation is not None and generation > first and warm[:2] == RANKS

    eventually(regrouped, timeout=PODS_UP, message="both ranks planned into a new generation")
    result = eventually(lambda: _ok(step(ip)), timeout=ROUND_UP, message="a step after it")
    assert result["ok"]
    eventually(lambda: engine_digest(engine, ENGINE_PORT) == trainer_digest(ip),
               timeout=ROUND_UP, message="engine at the trainer's weights")  # fmt: skip
    no_tracebacks(cluster, operator, namespace)


def test_a_pod_of_two_ranks_feeds_its_colocated_engine_of_two_workers(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    """Colocated: both ranks' agents form the group alone (no engine member); the lead
    hands each bucket to the engine on the pod's node, a copy for each of its two
    tensor-parallel workers, and both workers serve the trainer's weights bit for bit."""
    sync = weightsync()
    sync["spec"]["mode"] = "Colocated"
    sync["spec"]["trainer"].update(sourceRanks=["all"], ranksPerPod=2)
    deployment = engines(replicas=1)
    deployment["spec"]["template"]["spec"]["containers"][0]["command"] += ["--tp", "2"]
    apply(cluster, namespace, two_rank_trainer(), deployment, sync)

    _, warm = _warm_group(cluster, namespace, 2)
    assert warm == RANKS  # the engine is no member: the lead loads it
    (pod,) = pods(cluster, namespace, "trainer")
    ip = pod["status"]["podIP"]
    engine = _two_steps_to_ready(cluster, namespace, ip)
    assert engine["spec"]["nodeName"] == pod["spec"]["nodeName"]
    want = trainer_digest(ip)
    served = engine_digest(engine, ENGINE_PORT)
    assert (served["version"], served["tensors"]) == (want["version"], want["tensors"])
    assert [w["tensors"] == want["tensors"] for w in served["workers"]] == [True, True]
    no_tracebacks(cluster, operator, namespace)


def _ok(result: dict[str, Any]) -> dict[str, Any] | None:
    return result if result["ok"] else None
