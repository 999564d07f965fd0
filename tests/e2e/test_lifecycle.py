"""The WeightSync's own lifecycle on the real node: a name as long as Kubernetes allows,
a WeightSync deleted mid-round and created again (its agents keep their token), and an
engine kept behind its agent's front (`spec.inference[].front`).

Real operator process, agents, reference engines and trainer as containers on the local
cluster's real node (`tests/support/operator.py`).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.e2e.test_recovery import (
    AGENT_HTTP_PORT,
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
from tests.support.recovery import agent_token, engine_digest, http_json
from weightsync.controller import names

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# The longest name a WeightSync can have: a DNS subdomain of 253 characters.
LONG_NAME = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
BACK_WITHIN_SECONDS = 60.0
FRONT_PORT = 8001


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


def _send(ip: str, port: int, target: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST `target` as written (no client-side normalizing) from outside the pod."""
    connection = http.client.HTTPConnection(ip, port, timeout=30)
    try:
        payload = json.dumps(body)
        connection.request("POST", target, payload, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        connection.close()


def _refuses_connections(ip: str, port: int) -> bool:
    try:
        http.client.HTTPConnection(ip, port, timeout=5).connect()
    except ConnectionRefusedError:
        return True
    return False


def test_a_front_refuses_foreign_update_calls_and_forwards_inference(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, k8s: Any
) -> None:
    deployment = engines(replicas=1)
    engine = deployment["spec"]["template"]["spec"]["containers"][0]
    engine["command"][engine["command"].index("$(POD_IP)")] = "127.0.0.1"  # loopback only
    engine["readinessProbe"]["httpGet"]["port"] = FRONT_PORT  # through the front
    sync = weightsync()
    sync["spec"]["inference"][0]["front"] = {"port": FRONT_PORT}
    apply(cluster, namespace, trainer(), deployment, sync)
    eventually(lambda: in_group(cluster, namespace, 2), timeout=PODS_UP, message="group warm")
    (pod,) = pods(cluster, namespace, "engine")
    ip = pod["status"]["podIP"]
    # The engine answers on the pod's loopback only; the agent says so in its status.
    token = agent_token(k8s, namespace, names.token_secret_name("sync"))
    agent_status = f"http://{ip}:{AGENT_HTTP_PORT}/v1/status?with=front"
    eventually(
        lambda: (
            http_json("GET", agent_status, token=token)["front"]
            == {"port": FRONT_PORT, "engine_exposed": False}
        ),
        timeout=PODS_UP,
        message="the agent has checked its engine's exposure",
    )
    assert _refuses_connections(ip, ENGINE_PORT)  # the engine is up, on loopback only
    # A caller from outside the pod cannot start an update, however it writes the path.
    for target in ["/v1/update/begin", "//v1/update/begin", "/v1/%75pdate/begin",
                   "/generate/../v1/update/begin"]:  # fmt: skip
        status, answer = _send(ip, FRONT_PORT, target, {"version": 99})
        assert (status, answer.get("error")) == (403, "private_route"), (target, answer)
    health = http_json("GET", f"http://{ip}:{FRONT_PORT}/health", timeout=5)
    assert health["detail"] != "updating"
    # The pod's own agent still loads it: a round reaches the engine behind the front.
    (source,) = pods(cluster, namespace, "trainer")
    trainer_ip = source["status"]["podIP"]
    url = f"http://{trainer_ip}:{TRAINER_PORT}/digest"
    eventually(lambda: answers(url), timeout=PODS_UP, message="trainer serving")
    assert step(trainer_ip)["ok"]
    (serving,) = eventually(
        lambda: ready(cluster, namespace, "engine", 1), timeout=ROUND_UP, message="engine Ready"
    )
    assert engine_digest(serving, FRONT_PORT) == trainer_digest(trainer_ip)
    status, answer = _send(ip, FRONT_PORT, "/generate", {"input_ids": [[1, 2, 3]]})
    assert status == 200
    assert answer["weight_version"] == trainer_digest(trainer_ip)["version"]
    no_tracebacks(cluster, operator, namespace)
