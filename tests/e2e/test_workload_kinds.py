"""A JobSet trainer and LeaderWorkerSet engines, under the JobSet and LWS controllers.

The trainer is a JobSet (one replicated job, one indexed pod) and the engines an LWS of
two groups, each a leader (the reference engine, the sidecar, the readiness gate) and a
worker; the pods, their Jobs and StatefulSets, labels and indexes are made by the
projects' own controllers and pod webhooks (`tests.cluster.workload_controllers`). The
operator plans the trainer pod as rank 0 and each group's leader as one engine: a round
reaches both leaders bit for bit, the workers get no sidecar. When a leader pod is
deleted, LWS recreates its whole group; the new leader recovers the current version from
a holder and turns Ready only when it serves it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.cluster.workload_controllers import WorkloadControllers
from tests.e2e.test_recovery import ROUND_UP, answers, no_tracebacks
from tests.support.eventually import eventually
from tests.support.kube import condition
from tests.support.operator import (
    ENGINE_IMAGE,
    ENGINE_PORT,
    PODS_UP,
    TRAINER_PORT,
    OperatorProcess,
    apply,
    engines,
    get,
    has_sidecar,
    pods,
    reason,
    step,
    sync_status,
    template,
    trainer,
    trainer_digest,
    weightsync,
)
from tests.support.recovery import engine_digest
from weightsync.api import reasons
from weightsync.controller import names

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LEADER = "leaderworkerset.sigs.k8s.io/worker-index=0"


@pytest.fixture(scope="module")
def controllers(cluster: LocalCluster) -> Iterator[WorkloadControllers]:
    running = WorkloadControllers(cluster)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def jobset_trainer() -> dict[str, Any]:
    pod = trainer()["spec"]["template"]
    pod["spec"]["restartPolicy"] = "OnFailure"  # a Job's pods may not restart Always
    job = {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": pod}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "trainer"},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1,
                                     "template": {"spec": job}}]},
    }  # fmt: skip


def lws_engines(groups: int) -> dict[str, Any]:
    leader = engines(replicas=1)["spec"]["template"]
    worker = {
        "name": "worker",
        "image": ENGINE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sleep", "infinity"],
    }
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "engine"},
        "spec": {
            "replicas": groups,
            "leaderWorkerTemplate": {
                "size": 2,
                "leaderTemplate": leader,
                "workerTemplate": template("engine-worker", [worker], inject=True, local=True),
            },
        },
    }


def leaders(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = get(cluster, namespace, "pods", "-l", LEADER)["items"]
    return sorted(found, key=lambda p: p["metadata"]["name"])


def serving(cluster: LocalCluster, namespace: str, version: int) -> list[dict[str, Any]] | None:
    """Both leaders Ready (gate and containers) and running, at `version`; else None."""
    found = [p for p in leaders(cluster, namespace) if p["status"].get("podIP")]
    ready = [p for p in found if condition(p, "Ready") == "True"]
    if len(ready) != 2:
        return None
    if any(engine_digest(p, ENGINE_PORT)["version"] != version for p in ready):
        return None
    return ready


def test_a_jobset_trainer_syncs_lws_engine_groups_and_a_replaced_group_recovers(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess,
    controllers: WorkloadControllers,
) -> None:  # fmt: skip
    sync = weightsync()
    sync["spec"]["trainer"] = {"jobSetRef": {"name": "trainer"}}
    sync["spec"]["inference"] = [
        {"leaderWorkerSetRef": {"name": "engine"}, "engine": "Reference", "port": ENGINE_PORT}
    ]
    # ---- the JobSet first: its pod misses the webhook (no WeightSync selects it yet). It
    # is reported, not deleted: its Job would count it failed and the JobSet would fail.
    apply(cluster, namespace, jobset_trainer())
    (early,) = eventually(lambda: pods(cluster, namespace, "trainer"), timeout=PODS_UP,
                          message="the JobSet's pod")  # fmt: skip
    apply(cluster, namespace, lws_engines(groups=2), sync)
    eventually(
        lambda: (reason(sync_status(cluster, namespace), "Degraded") or ("", ""))[1]
        == reasons.SIDECAR_MISSING,
        timeout=PODS_UP, message="Degraded: the trainer pod has no sidecar",
    )  # fmt: skip
    jobset = get(cluster, namespace, "jobset", "trainer")
    assert "terminalState" not in jobset.get("status", {}), jobset["status"]
    (still,) = pods(cluster, namespace, "trainer")
    assert still["metadata"]["uid"] == early["metadata"]["uid"]
    assert not has_sidecar(still)
    # What the condition tells the user: the JobSet again, now that the WeightSync exists.
    cluster.kubectl("delete", "jobset", "trainer", "-n", namespace, "--cascade=foreground")
    apply(cluster, namespace, jobset_trainer())

    def warm_members() -> list[dict[str, Any]] | None:
        members = sync_status(cluster, namespace).get("members") or []
        return members if len(members) == 3 and all(m.get("warm") for m in members) else None

    members = eventually(warm_members, timeout=PODS_UP, message="trainer and 2 leaders warm")
    (trainer_pod,) = pods(cluster, namespace, "trainer")
    groups = leaders(cluster, namespace)
    assert [(m["rank"], m["role"]) for m in members] == [(0, "Source"), (1, "Sink"), (2, "Sink")]
    assert members[0]["pod"] == trainer_pod["metadata"]["name"]
    assert {m["pod"] for m in members[1:]} == {p["metadata"]["name"] for p in groups}
    assert has_sidecar(trainer_pod)
    assert all(has_sidecar(p) for p in groups)
    assert all(p["spec"]["readinessGates"] == [{"conditionType": names.WEIGHTS_CURRENT}]
               for p in groups)  # fmt: skip
    workers = pods(cluster, namespace, "engine-worker")
    assert len(workers) == 2
    assert not any(has_sidecar(p) for p in workers)

    ip = trainer_pod["status"]["podIP"]
    eventually(lambda: answers(f"http://{ip}:{TRAINER_PORT}/digest"), timeout=PODS_UP,
               message="trainer serving")  # fmt: skip
    for _ in range(2):
        result = step(ip)
        assert result["ok"], result
    expected = trainer_digest(ip)
    ready = eventually(lambda: serving(cluster, namespace, expected["version"]),
                       timeout=ROUND_UP, message="both leaders Ready")  # fmt: skip
    assert all(engine_digest(p, ENGINE_PORT) == expected for p in ready)

    # ---- a leader deleted: LWS recreates the group (leader and worker), the new
    # leader recovers the current version before it turns Ready
    gone = groups[0]
    cluster.kubectl("delete", "pod", "-n", namespace, gone["metadata"]["name"], "--wait=false")

    def replaced() -> list[dict[str, Any]] | None:
        now = serving(cluster, namespace, expected["version"])
        uids = {p["metadata"]["uid"] for p in now or []}
        return now if now and gone["metadata"]["uid"] not in uids else None

    ready = eventually(replaced, timeout=ROUND_UP, message="the replaced group's leader Ready")
    assert all(engine_digest(p, ENGINE_PORT) == expected for p in ready)
    assert sync_status(cluster, namespace).get("currentVersion") == expected["version"]
    result = step(ip)
    assert result["ok"], result
    no_tracebacks(cluster, operator, namespace)
