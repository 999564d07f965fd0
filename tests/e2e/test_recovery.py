"""P2P recovery end to end: killed engines come back by pulling from holders, never stale.

Real operator process, agents, reference engines and trainer as pod-runner processes on
the local control plane (`tests/cluster/test_operator_support.py`), Mooncake over TCP.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.cluster.test_operator_support import (
    ENGINE_PORT,
    PODS_UP,
    TRAINER_PORT,
    OperatorProcess,
    apply,
    crd_installed,  # noqa: F401 - fixture
    engines,
    events,
    operator_process,  # noqa: F401 - fixture
    pods,
    ready,
    step,
    sync_status,
    trainer,
    weightsync,
)
from tests.support.eventually import eventually
from tests.support.kube import condition, watch_pods_until
from tests.support.recovery import ReadyWatch, engine_digest, http_json, kill_container

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

KILLS = 10
ROUND_UP = 120.0


def start_stack(cluster: LocalCluster, namespace: str, *, holders: int = 1) -> str:
    """Trainer, two engines, a WeightSync with TCP recovery; version 1 synced. The trainer IP."""
    sync = weightsync()
    sync["spec"]["recovery"] = {"protocol": "TCP", "holders": holders}
    apply(cluster, namespace, trainer(), engines(replicas=2), sync)
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


def trainer_digest(ip: str) -> dict[str, Any]:
    result: dict[str, Any] = http_json("GET", f"http://{ip}:{TRAINER_PORT}/digest")
    return result


def no_tracebacks(cluster: LocalCluster, operator: OperatorProcess, namespace: str) -> None:
    logs = {"operator": operator.output()}
    for path in cluster.state_dir.glob(f"pods/{namespace}_*/*.log"):
        logs[str(path)] = path.read_text(errors="replace")
    bad = {name: text[-2000:] for name, text in logs.items() if "Traceback" in text}
    assert bad == {}


def replace_one(
    cluster: LocalCluster, k8s: Any, namespace: str, rng: random.Random
) -> dict[str, Any]:
    """Kill a random engine's process; its replacement once Ready (watched, not polled)."""
    before = pods(cluster, namespace, "engine")
    victim = rng.choice([p for p in before if condition(p, "Ready") == "True"])
    kill_container(cluster.pid_dir, victim, "engine")
    known = {p["metadata"]["name"] for p in before}
    return watch_pods_until(
        k8s,
        namespace,
        lambda _type, p: p["metadata"]["name"] not in known and condition(p, "Ready") == "True",
        timeout=PODS_UP,
        label_selector="app=engine",
    )


def test_engines_killed_between_rounds_recover_from_the_holder(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, k8s: Any
) -> None:
    trainer_ip = start_stack(cluster, namespace)
    rng = random.Random(6)
    replacements = []
    trainer_url = f"http://{trainer_ip}:{TRAINER_PORT}"
    with ReadyWatch(k8s, namespace, "app=engine", ENGINE_PORT, trainer_url) as watcher:
        for _ in range(KILLS):
            expected = trainer_digest(trainer_ip)
            replacement = replace_one(cluster, k8s, namespace, rng)
            name = replacement["metadata"]["name"]
            replacements.append(name)
            assert engine_digest(replacement, ENGINE_PORT) == expected  # bit-identical
            eventually(
                lambda: in_group(cluster, namespace, 3, name),  # noqa: B023 - called at once
                timeout=ROUND_UP,
                message=f"{name} planned into the group",
            )
            result = step(trainer_ip)
            assert result["ok"], result
            current = trainer_digest(trainer_ip)
            serving = eventually(
                lambda: ready(cluster, namespace, "engine", 2),
                timeout=ROUND_UP,
                message="both engines Ready after the round",
            )
            for engine in serving:
                assert engine_digest(engine, ENGINE_PORT) == current  # every engine synced
    assert ("Normal", "Recovered") in events(cluster, namespace)
    # Ready only ever at the version the trainer held at that moment (kills happen
    # between rounds, so nothing moves while a replacement turns Ready).
    answered = {name: (v, cur) for name, v, cur in watcher.seen if v is not None}
    assert set(replacements) <= set(answered)
    stale = {name: vc for name, vc in answered.items() if vc[0] != vc[1]}
    assert stale == {}
    no_tracebacks(cluster, operator, namespace)
