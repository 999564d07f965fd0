"""The WeightSync's own lifecycle on the real node: a name as long as Kubernetes allows,
and a WeightSync deleted mid-round and created again (its agents keep their token).

Real operator process, agents, reference engines and trainer as containers on the local
cluster's real node (`tests/support/operator.py`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.e2e.test_recovery import (
    BUCKET_DELAY_SECONDS,
    ROUND_UP,
    answers,
    engine_health,
    in_group,
    no_tracebacks,
    start_stack,
)
from tests.support.eventually import eventually
from tests.support.operator import (
    ENGINE_PORT,
    PODS_UP,
    TRAINER_PORT,
    OperatorProcess,
    apply,
    engines,
    pods,
    ready,
    step,
    sync_status,
    trainer,
    trainer_digest,
    weightsync,
)
from tests.support.recovery import engine_digest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# The longest name a WeightSync can have: a DNS subdomain of 253 characters.
LONG_NAME = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
BACK_WITHIN_SECONDS = 60.0


def test_a_weightsync_with_a_253_character_name_syncs(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    assert len(LONG_NAME) == 253
    sync = weightsync(name=LONG_NAME)
    apply(cluster, namespace, trainer(), engines(replicas=2), sync)

    def warm() -> bool:
        status = sync_status(cluster, namespace, LONG_NAME)
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        return conditions.get("Prewarmed") == "True" and len(status.get("members") or []) == 3

    eventually(warm, timeout=PODS_UP, message="the long-named WeightSync's group warm")
    (source,) = pods(cluster, namespace, "trainer")
    ip = source["status"]["podIP"]
    url = f"http://{ip}:{TRAINER_PORT}/digest"
    eventually(lambda: answers(url), timeout=PODS_UP, message="trainer serving")
    assert step(ip)["ok"]
    serving = eventually(
        lambda: ready(cluster, namespace, "engine", 2), timeout=ROUND_UP, message="engines Ready"
    )
    expected = trainer_digest(ip)
    assert [engine_digest(p, ENGINE_PORT) == expected for p in serving] == [True, True]
    no_tracebacks(cluster, operator, namespace)


def test_a_weightsync_deleted_mid_round_and_created_again_is_ready_within_a_minute(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    trainer_ip = start_stack(
        cluster, namespace, preset="small", bucket_delay_seconds=BUCKET_DELAY_SECONDS
    )
    outcome: list[dict[str, Any] | BaseException] = []

    def publish() -> None:
        try:
            outcome.append(step(trainer_ip))
        except BaseException as exc:  # handed to the test thread below
            outcome.append(exc)

    thread = threading.Thread(target=publish, name="step")
    thread.start()
    victim = ready(cluster, namespace, "engine", 2)[0]
    eventually(
        lambda: engine_health(victim)["detail"] == "updating",
        timeout=ROUND_UP,
        interval=0.01,
        message="the round reached an engine",
    )
    sync = weightsync()
    sync["spec"]["recovery"] = {"protocol": "TCP", "holders": 1}
    sync["spec"]["transfer"]["bucketSizeBytes"] = 4 << 20
    cluster.kubectl("delete", "weightsync", "sync", "-n", namespace, "--timeout=60s")
    apply(cluster, namespace, sync)
    created = time.monotonic()
    thread.join(timeout=120)
    assert not thread.is_alive()

    def current_and_ready() -> list[dict[str, Any]]:
        status = sync_status(cluster, namespace)
        version = status.get("currentVersion")
        serving = ready(cluster, namespace, "engine", 2)
        if version is None or not serving:
            return []
        served = [engine_digest(p, ENGINE_PORT)["version"] for p in serving]
        return serving if served == [version, version] else []

    eventually(current_and_ready, timeout=BACK_WITHIN_SECONDS, message="Ready at current")
    back_seconds = time.monotonic() - created
    assert back_seconds < BACK_WITHIN_SECONDS
    # The next round reaches both, bit-identical: nobody was cut off.
    eventually(lambda: in_group(cluster, namespace, 3), timeout=ROUND_UP, message="group")
    assert step(trainer_ip)["ok"]
    serving = eventually(
        lambda: ready(cluster, namespace, "engine", 2), timeout=ROUND_UP, message="both Ready"
    )
    expected = trainer_digest(trainer_ip)
    assert [engine_digest(p, ENGINE_PORT) == expected for p in serving] == [True, True]
    no_tracebacks(cluster, operator, namespace)
