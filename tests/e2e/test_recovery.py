"""P2P recovery end to end: replaced engine pods come back by pulling from holders, never
stale; members lost mid-round fail the round together.

Real operator process, agents, reference engines and trainer as containers on the local
cluster's real node (`tests/support/operator.py`), Mooncake over TCP. A pod
"replaced" is deleted at once (a node failure or an eviction): its Deployment makes a
new one, which starts from nothing.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.controlplane import LocalCluster
from tests.support.eventually import eventually
from tests.support.kube import condition, watch_pods_until
from tests.support.operator import (
    ENGINE_PORT,
    PODS_UP,
    TRAINER_PORT,
    OperatorProcess,
    apply,
    engines,
    events,
    pods,
    ready,
    step,
    sync_status,
    trainer,
    trainer_digest,
    weightsync,
)
from tests.support.recovery import (
    ReadyWatch,
    agent_token,
    engine_digest,
    http_json,
    kill_container,
    pod_logs,
    replace_pod,
)
from weightsync.controller import names

# Engine pods replaced per scenario: 4 in CI (seeded: with seed 16 each mid-round kill
# lands within 0.7 s of the round reaching the victim), 10 with `make chaos`; engine
# containers restarted in place: half that (every other one followed by a round).
KILLS = int(os.environ.get("RECOVERY_KILLS", "4"))
RESTARTS = KILLS // 2
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300 + 60 * KILLS)]
ROUND_UP = 120.0
SLOW_BUCKET_BYTES = 4 << 20  # the small preset in 27 buckets
BUCKET_DELAY_SECONDS = 0.05  # per bucket on the engines' agents: rounds of ~1.5 s
TRANSFER_TIMEOUT_SECONDS = 30  # `weightsync()`'s transfer.timeoutSeconds
# A failed round ends within its timeout: its failure path (telling the peers, reading
# their accounts, aborting the engine) runs in the last `agent.rounds.FAILURE_GRACE_SECONDS`
# of it. The slack is the agent's own clock reading and scheduling on a loaded machine
# (the failure path took up to 1.03 s past the timeout before it was moved inside).
OVERRUN_LIMIT_SECONDS = 0.25
AGENT_HTTP_PORT = 8470  # the operator's default for the agents' control API


def start_stack(
    cluster: LocalCluster,
    namespace: str,
    *,
    holders: int = 1,
    preset: str = "tiny",
    bucket_delay_seconds: float = 0.0,
) -> str:
    """Trainer, two engines, a WeightSync with TCP recovery; version 1 synced. The trainer IP.

    `preset` "small" (111 MB) with `SLOW_BUCKET_BYTES` buckets and a per-bucket delay on the
    engines' agents makes rounds and recoveries last long enough to kill something in them.
    """
    sync = weightsync()
    sync["spec"]["recovery"] = {"protocol": "TCP", "holders": holders}
    if preset != "tiny":
        sync["spec"]["transfer"]["bucketSizeBytes"] = SLOW_BUCKET_BYTES
    slow = engines(replicas=2, preset=preset, bucket_delay_seconds=bucket_delay_seconds)
    apply(cluster, namespace, trainer(preset=preset), slow, sync)
    eventually(lambda: in_group(cluster, namespace, 3), timeout=PODS_UP, message="group warm")
    (source,) = pods(cluster, namespace, "trainer")
    ip: str = source["status"]["podIP"]
    eventually(lambda: answers(f"http://{ip}:{TRAINER_PORT}/digest"), timeout=PODS_UP,
               message="trainer serving")  # fmt: skip
    assert step(ip)["ok"]
    eventually(lambda: ready(cluster, namespace, "engine", 2), timeout=ROUND_UP, message="ready")
    return ip


def answers(url: str) -> bool:
    try:
        http_json("GET", url, timeout=5)
    except OSError:
        return False
    return True


def in_group(cluster: LocalCluster, namespace: str, count: int, pod: str = "") -> bool:
    status = sync_status(cluster, namespace)
    members = [m["pod"] for m in status.get("members") or []]
    warm = any(
        c["type"] == "Prewarmed" and c["status"] == "True" for c in status.get("conditions") or []
    )
    return warm and len(members) == count and (not pod or pod in members)


def no_tracebacks(cluster: LocalCluster, operator: OperatorProcess, namespace: str) -> None:
    logs = {"operator": operator.output(), **pod_logs(cluster, namespace)}
    # From the first traceback on: the failure shows what raised, not the log's last lines.
    bad = {
        name: text[max(0, text.index("Traceback") - 300) :][:4000]
        for name, text in logs.items()
        if "Traceback" in text
    }
    assert bad == {}, "\n\n".join(f"== {name}\n{text}" for name, text in bad.items())


def replace_one(
    cluster: LocalCluster, k8s: Any, namespace: str, rng: random.Random
) -> dict[str, Any]:
    """Replace a random engine's pod; its replacement once Ready (watched, not polled)."""
    before = pods(cluster, namespace, "engine")
    victim = rng.choice([p for p in before if condition(p, "Ready") == "True"])
    replace_pod(cluster, victim)
    known = {p["metadata"]["name"] for p in before}
    return watch_pods_until(
        k8s,
        namespace,
        lambda _type, p: p["metadata"]["name"] not in known and condition(p, "Ready") == "True",
        timeout=PODS_UP,
        label_selector="app=engine",
    )


def test_engines_replaced_between_rounds_recover_from_the_holder(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, k8s: Any
) -> None:
    trainer_ip = start_stack(cluster, namespace)
    rng = random.Random(6)
    replacements = []

    def trainer_version() -> int:
        version: int = trainer_digest(trainer_ip)["version"]
        return version

    with ReadyWatch(k8s, namespace, "app=engine", ENGINE_PORT, trainer_version) as watcher:
        for _ in range(KILLS):
            expected = trainer_digest(trainer_ip)
            replacement = replace_one(cluster, k8s, namespace, rng)
            name = replacement["metadata"]["name"]
            replacements.append(name)
            assert engine_digest(replacement, ENGINE_PORT) == expected  # bit-identical
            joins_and_syncs(cluster, namespace, trainer_ip, name)
    assert ("Normal", "Recovered") in events(cluster, namespace)
    # Ready only ever at the version the trainer held at that moment (kills happen
    # between rounds, so nothing moves while a replacement turns Ready).
    answered = {name: (v, cur) for name, v, cur in watcher.seen if v is not None}
    assert set(replacements) <= set(answered)
    stale = {name: vc for name, vc in answered.items() if vc[0] != vc[1]}
    assert stale == {}
    no_tracebacks(cluster, operator, namespace)


def test_engine_containers_restarted_in_place_are_held_out_until_current(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, k8s: Any
) -> None:
    """The kubelet restarts a crashed engine container in the same pod, at the same IP,
    with the weights it loads at start: its gate stays False until its agent has brought it
    to the current version (recovery from the holder, no round needed)."""
    trainer_ip = start_stack(cluster, namespace)
    rng = random.Random(13)

    def trainer_version() -> int:
        version: int = trainer_digest(trainer_ip)["version"]
        return version

    with ReadyWatch(
        k8s, namespace, "app=engine", ENGINE_PORT, trainer_version, container="engine"
    ) as watcher:
        for kill in range(RESTARTS):
            expected = trainer_digest(trainer_ip)
            victim = rng.choice(ready(cluster, namespace, "engine", 2))
            name = victim["metadata"]["name"]
            attempt = kill_container(cluster.node, victim, "engine")

            def back(name: str = name, attempt: int = attempt) -> dict[str, Any] | None:
                pod = next(p for p in pods(cluster, namespace, "engine")
                           if p["metadata"]["name"] == name)  # fmt: skip
                restarts = {
                    c["name"]: c["restartCount"] for c in pod["status"]["containerStatuses"]
                }
                ok = restarts["engine"] > attempt and condition(pod, "Ready") == "True"
                return pod if ok else None

            pod = eventually(back, timeout=ROUND_UP, message=f"{name} restarted and Ready")
            assert pod["status"]["podIP"] == victim["status"]["podIP"]  # in place
            served = engine_digest(pod, ENGINE_PORT)
            # bit-identical, no round; else the victim's logs say how it got there
            assert served == expected, victim_logs(cluster, namespace, name)
            if kill % 2:
                joins_and_syncs(cluster, namespace, trainer_ip, name)
    # Every Ready the watcher saw served what the trainer held then (a watch may merge a
    # quick False-True flip: it counts no transitions).
    answered = [(name, v, cur) for name, v, cur in watcher.seen if v is not None]
    assert [entry for entry in answered if entry[1] != entry[2]] == []
    # The engine container itself (its probe answered by its agent) turned ready only
    # on the current version: the kubelet cannot make the pod Ready on a cached gate.
    assert len(watcher.container_seen) >= RESTARTS
    assert [entry for entry in watcher.container_seen if entry[1] != entry[2]] == []
    assert ("Normal", "Recovered") in events(cluster, namespace)
    no_tracebacks(cluster, operator, namespace)


def victim_logs(cluster: LocalCluster, namespace: str, pod: str, tail: int = 4000) -> str:
    """The last lines of every log of `pod`'s containers, restarts included."""
    return "\n".join(
        f"--- {path}\n{text[-tail:]}"
        for path, text in sorted(pod_logs(cluster, namespace).items())
        if f"_{pod}_" in path
    )


def engine_health(pod: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = http_json(
        "GET", f"http://{pod['status']['podIP']}:{ENGINE_PORT}/health", timeout=5
    )
    return result


def agent_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{AGENT_HTTP_PORT}"


def agent_status(pod: dict[str, Any], token: str) -> dict[str, Any]:
    status: dict[str, Any] = http_json("GET", f"{agent_url(pod)}/v1/status", 5, token)
    return status


def finished(recovery: dict[str, Any]) -> dict[str, Any] | None:
    return recovery if recovery.get("state") in ("done", "failed") else None


def current_version(k8s: Any, namespace: str) -> Callable[[], int | None]:
    """The WeightSync's `status.currentVersion`: what a Ready engine must serve."""
    api = client.CustomObjectsApi(k8s)

    def read() -> int | None:
        sync = api.get_namespaced_custom_object(
            "weightsync.io", "v1alpha1", namespace, "weightsyncs", "sync"
        )
        version: int | None = (sync.get("status") or {}).get("currentVersion")
        return version

    return read


def test_engines_replaced_mid_round_fail_the_round_together_or_miss_it(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, k8s: Any
) -> None:
    """A round either fails on every rank (no engine keeps a partial update; the survivor
    serves the old or, if it had committed before the loss, the new version, never a mix)
    or completes without the lost pod; `publish` says which; then everyone converges."""
    trainer_ip = start_stack(
        cluster, namespace, preset="small", bucket_delay_seconds=BUCKET_DELAY_SECONDS
    )
    rng = random.Random(16)
    outcomes: list[str] = []
    with ReadyWatch(
        k8s, namespace, "app=engine", ENGINE_PORT, current_version(k8s, namespace)
    ) as watcher:
        for _ in range(KILLS):
            old = trainer_digest(trainer_ip)
            victim, survivor = rng.sample(ready(cluster, namespace, "engine", 2), 2)
            before = {p["metadata"]["name"] for p in pods(cluster, namespace, "engine")}
            with ThreadPoolExecutor(1) as pool:
                publish = pool.submit(step, trainer_ip)
                eventually(
                    lambda: engine_health(victim)["detail"] == "updating",  # noqa: B023
                    timeout=ROUND_UP,
                    interval=0.01,
                    message="the round reached the victim's engine",
                )
                time.sleep(rng.uniform(0.0, 27 * BUCKET_DELAY_SECONDS))
                replace_pod(cluster, victim)
                result = publish.result(timeout=ROUND_UP)
            new = trainer_digest(trainer_ip)
            assert result["version"] == new["version"] == old["version"] + 1
            # A round the transport cannot fail early (the victim's connections were not
            # closed) fails at its deadline: 31.02 s once in CI.
            overrun = result["duration_seconds"] - TRANSFER_TIMEOUT_SECONDS
            assert overrun <= OVERRUN_LIMIT_SECONDS, result
            left = engine_digest(survivor, ENGINE_PORT)
            if result["ok"]:
                assert left == new  # completed without the victim
                outcomes.append("completed")
            else:
                assert result["reason"], result
                assert result["message"], result
                assert left in (old, new)  # whole versions only: aborted, or had committed
                outcomes.append(result["reason"])
            converge(cluster, namespace, k8s, trainer_ip, before)
    assert any(o != "completed" for o in outcomes), outcomes  # the kills landed in rounds
    answered = {name: (v, cur) for name, v, cur in watcher.seen if v is not None}
    stale = {name: vc for name, vc in answered.items() if vc[0] != vc[1]}
    assert stale == {}
    no_tracebacks(cluster, operator, namespace)


def converge(
    cluster: LocalCluster, namespace: str, k8s: Any, trainer_ip: str, known: set[str]
) -> None:
    """The victim's replacement joins the group; the next round reaches everyone.

    It recovers first if a holder has the current version; when the lost round had
    committed on the survivor (the current version moved past what any holder kept), it is
    admitted at once and the next round brings it current.
    """
    replacement = watch_pods_until(
        k8s,
        namespace,
        lambda _type, p: p["metadata"]["name"] not in known and bool(p["status"].get("podIP")),
        timeout=PODS_UP,
        label_selector="app=engine",
    )
    joins_and_syncs(cluster, namespace, trainer_ip, replacement["metadata"]["name"])


def joins_and_syncs(cluster: LocalCluster, namespace: str, trainer_ip: str, name: str) -> None:
    """`name` is planned into the group, and the next round brings both engines to the
    trainer's bytes."""
    eventually(
        lambda: in_group(cluster, namespace, 3, name),
        timeout=ROUND_UP,
        message=f"{name} planned into the group",
    )
    result = step(trainer_ip)
    assert result["ok"], result
    current = trainer_digest(trainer_ip)
    serving = eventually(
        lambda: ready(cluster, namespace, "engine", 2), timeout=ROUND_UP, message="both Ready"
    )
    assert [engine_digest(e, ENGINE_PORT) == current for e in serving] == [True, True]


def test_a_holder_killed_during_a_recovery_is_replaced_by_the_other(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, k8s: Any
) -> None:
    trainer_ip = start_stack(
        cluster, namespace, holders=2, preset="small", bucket_delay_seconds=BUCKET_DELAY_SECONDS
    )
    assert step(trainer_ip)["ok"]  # the sink holder commits a copy in this round too
    eventually(
        lambda: ready(cluster, namespace, "engine", 2), timeout=ROUND_UP, message="ready at v2"
    )
    expected = trainer_digest(trainer_ip)
    token = agent_token(k8s, namespace, names.token_secret_name("sync"))
    engine_pods = {p["metadata"]["name"]: p for p in pods(cluster, namespace, "engine")}
    holding = {name: agent_status(pod, token).get("holding") for name, pod in engine_pods.items()}
    (holder,) = [name for name, version in holding.items() if version == expected["version"]]
    (other,) = set(engine_pods) - {holder}
    replace_pod(cluster, engine_pods[other])

    def pulling(_type: str, pod: dict[str, Any]) -> bool:
        if pod["metadata"]["name"] in engine_pods or not pod["status"].get("podIP"):
            return False
        try:
            recovery = agent_status(pod, token).get("recovery") or {}
        except OSError:
            return False
        return recovery.get("state") == "running" and recovery.get("bytes", 0) > 0

    newcomer = eventually(
        lambda: next((p for p in pods(cluster, namespace, "engine") if pulling("", p)), None),
        timeout=PODS_UP,
        interval=0.02,
        message="the replacement pulling",
    )
    kill_container(cluster.node, engine_pods[holder], names.AGENT_CONTAINER)
    name = newcomer["metadata"]["name"]
    recovered = eventually(
        lambda: finished(agent_status(newcomer, token).get("recovery") or {}),
        timeout=ROUND_UP,
        message=f"{name} finished its recovery",
    )
    assert recovered["state"] == "done", recovered
    assert agent_url(engine_pods[holder]) in recovered["holders_failed"], recovered
    (source,) = pods(cluster, namespace, "trainer")
    assert agent_url(source) in recovered["holders_used"], recovered
    assert recovered["bytes"] == sync_status(cluster, namespace)["lastRound"]["bytes"]
    replacement = watch_pods_until(
        k8s,
        namespace,
        lambda _type, p: p["metadata"]["name"] == name and condition(p, "Ready") == "True",
        timeout=PODS_UP,
        label_selector="app=engine",
    )
    assert engine_digest(replacement, ENGINE_PORT) == expected
    no_tracebacks(cluster, operator, namespace)
