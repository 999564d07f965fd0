"""Colocated mode end to end: the operator names the engine on the trainer's node in the
source agent's plan, and the hand-off reaches it through the shared slots (shared memory
here, CUDA IPC on GPUs); a restarted operator keeps that choice; a replaced engine pod is
named in the next generation, and it and an engine container restarted in place are
reloaded by the trainer's agent from its held copy, without a round.

Real operator, webhook (hostIPC, node-local directory, affinity to the trainer's node),
scheduler, and agents, reference engine and trainer as containers on the real node.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.support.eventually import Timeouts, eventually
from tests.support.kube import condition, watch_pods_until
from tests.support.operator import (
    ENGINE_PORT,
    PODS_UP,
    OperatorProcess,
    apply,
    engines,
    gates,
    pods,
    ready,
    step,
    sync_status,
    trainer,
    trainer_digest,
    weightsync,
)
from tests.support.recovery import engine_digest, kill_container, replace_pod

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def prewarmed_generation(cluster: LocalCluster, namespace: str, after: int = 0) -> int | None:
    """The planned generation once it is newer than `after` and warm."""
    status = sync_status(cluster, namespace)
    warm = any(
        c["type"] == "Prewarmed" and c["status"] == "True" for c in status.get("conditions") or []
    )
    generation: int | None = status.get("groupGeneration")
    return generation if warm and generation is not None and generation > after else None


def test_the_colocated_engine_is_synced_through_the_plan_and_followed_when_replaced(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, k8s: Any
) -> None:
    sync = weightsync()
    sync["spec"]["mode"] = "Colocated"
    apply(cluster, namespace, trainer(), engines(replicas=1), sync)
    first = eventually(
        lambda: prewarmed_generation(cluster, namespace), timeout=PODS_UP, message="group warm"
    )
    members = sync_status(cluster, namespace)["members"]
    assert [(m["pod"], m["role"]) for m in members] == [("trainer-0", "Source")]
    (source,) = pods(cluster, namespace, "trainer")
    (engine,) = pods(cluster, namespace, "engine")
    assert engine["spec"]["nodeName"] == source["spec"]["nodeName"]  # the webhook's affinity
    assert engine["spec"]["hostIPC"] is True
    ip = source["status"]["podIP"]
    eventually(lambda: trainer_digest(ip), timeout=PODS_UP, message="trainer serving")

    result = step(ip)
    assert result["ok"], result
    (serving,) = eventually(
        lambda: ready(cluster, namespace, "engine", 1), timeout=Timeouts.ROUND, message="Ready"
    )
    assert engine_digest(serving, ENGINE_PORT) == trainer_digest(ip)  # bit-identical

    # A restarted operator reads its engine choice back from the source agent: the group
    # is not planned again (nor moved to another engine), and rounds go on in it.
    operator.stop()
    operator.start()
    eventually(
        lambda: operator.passes() >= 3, timeout=Timeouts.API, message="3 passes after restart"
    )
    assert sync_status(cluster, namespace)["groupGeneration"] == first
    result = step(ip)
    assert result["ok"], result
    assert result["generation"] == first
    assert engine_digest(serving, ENGINE_PORT) == trainer_digest(ip)

    # The engine's pod is replaced: the new one lands on the trainer's node, planned in.
    replace_pod(cluster, engine)
    gone = engine["metadata"]["name"]

    def started(_type: str, pod: dict[str, Any]) -> bool:
        return pod["metadata"]["name"] != gone and condition(pod, "ContainersReady") == "True"

    replacement = watch_pods_until(
        k8s, namespace, started, timeout=PODS_UP, label_selector="app=engine"
    )
    name = replacement["metadata"]["name"]
    assert replacement["spec"]["nodeName"] == source["spec"]["nodeName"]
    eventually(
        lambda: prewarmed_generation(cluster, namespace, after=first),
        timeout=PODS_UP,
        message="a new generation naming the replacement",
    )
    # No round: the trainer's agent reloads the new engine from the version it holds in
    # host memory (`agent.local_reload`); the pod turns Ready once it serves it.
    current = sync_status(cluster, namespace)["currentVersion"]
    eventually(
        lambda: gates(cluster, namespace).get(name) == ("True", "True"),
        timeout=Timeouts.ROUND,
        message=f"{name} Ready at version {current} without a round",
    )
    assert engine_digest(replacement, ENGINE_PORT) == trainer_digest(ip)
    assert trainer_digest(ip)["version"] == current

    # Its engine container killed: restarted in place on start-up weights, reloaded again.
    restarts = kill_container(cluster.node, replacement, "engine")

    def reloaded() -> bool:
        (pod,) = pods(cluster, namespace, "engine")
        statuses = {c["name"]: c for c in pod["status"].get("containerStatuses") or []}
        restarted = statuses.get("engine", {}).get("restartCount", 0) > restarts
        return restarted and gates(cluster, namespace).get(name) == ("True", "True")

    eventually(reloaded, timeout=Timeouts.ROUND, message="Ready again after the restart")
    assert engine_digest(replacement, ENGINE_PORT) == trainer_digest(ip)
    result = step(ip)
    assert result["ok"], result
    eventually(
        lambda: engine_digest(replacement, ENGINE_PORT) == trainer_digest(ip),
        timeout=Timeouts.ROUND,
        message="the next round reaches it",
    )
    eventually(
        lambda: sync_status(cluster, namespace)["currentVersion"] == result["version"],
        timeout=Timeouts.API,
        message="the status names the new version",
    )
