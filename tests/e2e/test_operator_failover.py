"""Operator HA: two operator processes elect a leader through a Lease; the leader is
killed during rounds and the standby takes over within the stated bound.

Two `weightsync-operator` processes serve the test's namespace with the same Lease
(`WEIGHTSYNC_OPERATOR_LEADER_LEASE`), as the chart's two replicas do. Both serve the
admission webhooks; only the Lease's holder reconciles. In URL mode the webhook
configuration names one process (the last started, the standby here: the chart's
Service routes to every ready replica instead), so killing the leader leaves admission
served. Rounds are trainer-driven and need no operator: at most the round in flight when
the leader dies may fail, none after it.

Bound: `LeaseTiming().takeover_bound_seconds` (15 s: a 10 s Lease, renewed every 2 s,
plus a read and a write) from the kill to the standby holding the Lease; its first
reconcile pass follows within `RECONCILE_AFTER_LEASE` (kopf's start and the first
pass).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.e2e.test_recovery import BUCKET_DELAY_SECONDS, start_stack
from tests.support.eventually import eventually
from tests.support.kube import condition
from tests.support.operator import (
    ENGINE_PORT,
    PODS_UP,
    OperatorProcess,
    has_sidecar,
    pods,
    ready,
    step,
    sync_status,
    trainer_digest,
)
from tests.support.recovery import engine_digest, pod_logs, replace_pod
from weightsync.controller.leadership.lease import LeaseTiming

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
LEASE = "weightsync-leader"
TAKEOVER_BOUND = LeaseTiming().takeover_bound_seconds
RECONCILE_AFTER_LEASE = 10.0  # the new leader's kopf start, indexes and first pass
ROUNDS_AFTER = 20.0  # seconds of rounds after the takeover


def replica(cluster: LocalCluster, namespace: str, workdir: Path, name: str) -> OperatorProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = {
        "WEIGHTSYNC_OPERATOR_LEADER_LEASE": LEASE,
        "WEIGHTSYNC_OPERATOR_IDENTITY": name,
    }
    return OperatorProcess(cluster, namespace, workdir, overrides)


def lease(cluster: LocalCluster, namespace: str) -> dict[str, Any]:
    result = cluster.kubectl("get", "lease", LEASE, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        return {}
    spec: dict[str, Any] = json.loads(result.stdout).get("spec") or {}
    return spec


def holder(cluster: LocalCluster, namespace: str) -> str:
    return str(lease(cluster, namespace).get("holderIdentity") or "")


@pytest.fixture(name="replicas")
def two_replicas(
    crd: LocalCluster, namespace: str, tmp_path: Path
) -> Iterator[tuple[OperatorProcess, OperatorProcess]]:
    """op-a started first (it takes the Lease), then op-b (standby; its URL is the one the
    webhook configuration keeps). Both stopped, and their webhooks removed, afterwards."""
    first = replica(crd, namespace, tmp_path / "op-a", "op-a")
    second = replica(crd, namespace, tmp_path / "op-b", "op-b")
    started: list[OperatorProcess] = []
    try:
        first.start()
        started.append(first)
        eventually(lambda: holder(crd, namespace) == "op-a", timeout=30, message="op-a leads")
        second.start()
        started.append(second)
        yield first, second
    finally:
        alive = [p for p in started if p.popen is not None and p.popen.poll() is None]
        if alive:  # WeightSyncs carry the leader's finalizer: delete them while one runs
            crd.kubectl(
                "delete", "weightsyncs", "--all", "-n", namespace, "--timeout=60s", check=False
            )
        for process in started:
            process.stop()
        first.delete_configurations()
        for process in started:
            print(f"== {process.log}\n{process.output()[-3000:]}")


@dataclass
class Rounds:
    """The trainer stepping in a loop: each step's (start, end, ok, version)."""

    ip: str
    done: list[tuple[float, float, bool, int]] = field(default_factory=list)
    in_flight_since: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            began = self.in_flight_since = time.monotonic()
            try:
                result = step(self.ip)
                ok, version = bool(result["ok"]), int(result.get("version") or 0)
            except OSError:
                ok, version = False, 0
            self.in_flight_since = None
            self.done.append((began, time.monotonic(), ok, version))

    def failed(self) -> list[tuple[float, float, bool, int]]:
        return [r for r in self.done if not r[2]]


def test_the_standby_takes_over_within_the_bound_when_the_leader_dies_mid_round(
    cluster: LocalCluster, namespace: str, replicas: tuple[OperatorProcess, OperatorProcess]
) -> None:
    leader, standby = replicas
    # Rounds of ~1.5 s (slowed buckets): the kill lands inside one.
    ip = start_stack(cluster, namespace, preset="small", bucket_delay_seconds=BUCKET_DELAY_SECONDS)
    assert holder(cluster, namespace) == "op-a"
    assert leader.passes() > 0
    assert standby.passes() == 0  # the standby reconciles nothing
    transitions = int(lease(cluster, namespace).get("leaseTransitions") or 0)

    rounds = Rounds(ip)
    publisher = threading.Thread(target=rounds.run, daemon=True)
    publisher.start()
    try:
        eventually(lambda: sum(ok for *_, ok, _ in rounds.done) >= 3, timeout=PODS_UP,
                   message="three rounds before the kill")  # fmt: skip
        eventually(
            lambda: (rounds.in_flight_since or 1e18) < time.monotonic() - 0.3,
            timeout=30, interval=0.02, message="a round in flight",
        )  # fmt: skip
        killed = time.monotonic()
        leader.stop(signal.SIGKILL)

        eventually(lambda: holder(cluster, namespace) == "op-b", timeout=TAKEOVER_BOUND + 30,
                   interval=0.2, message="op-b holds the Lease")  # fmt: skip
        took_lease = time.monotonic() - killed
        eventually(lambda: standby.passes() > 0, timeout=TAKEOVER_BOUND + RECONCILE_AFTER_LEASE,
                   interval=0.2, message="op-b reconciles")  # fmt: skip
        reconciling = time.monotonic() - killed
        time.sleep(ROUNDS_AFTER)
    finally:
        rounds.stop.set()
        publisher.join(timeout=120)

    print(f"lease taken {took_lease:.1f} s and reconciling {reconciling:.1f} s after the kill")
    assert took_lease <= TAKEOVER_BOUND
    assert reconciling <= TAKEOVER_BOUND + RECONCILE_AFTER_LEASE
    assert int(lease(cluster, namespace)["leaseTransitions"]) == transitions + 1
    # No failed round but the one in flight at the kill; rounds went on after it.
    in_flight = [r for r in rounds.failed() if r[0] <= killed <= r[1]]
    assert rounds.failed() == in_flight, rounds.failed()
    assert sum(1 for began, _, ok, _ in rounds.done if began > killed + took_lease and ok) >= 3

    # The new leader records the last round, and both engines serve its bytes.
    last = max(version for *_, ok, version in rounds.done if ok)
    eventually(lambda: sync_status(cluster, namespace).get("currentVersion") == last,
               timeout=30, message="op-b wrote the last version")  # fmt: skip
    expected = trainer_digest(ip)
    for pod in pods(cluster, namespace, "engine"):
        assert engine_digest(pod, ENGINE_PORT) == expected  # bit-identical

    # Admission (op-b's webhook) and reconcile (op-b) both serve a replaced engine pod.
    (victim, *_) = pods(cluster, namespace, "engine")
    replace_pod(cluster, victim)
    back = eventually(lambda: ready(cluster, namespace, "engine", 2), timeout=PODS_UP,
                      message="the replaced engine Ready")  # fmt: skip
    assert all(has_sidecar(p) and condition(p, "Ready") == "True" for p in back)

    logs = {"op-a": leader.output(), "op-b": standby.output(), **pod_logs(cluster, namespace)}
    assert [name for name, text in logs.items() if "Traceback" in text] == []
    assert "leading: op-b" in standby.output()


def test_a_leader_stopped_cleanly_hands_the_lease_over_at_once(
    cluster: LocalCluster, namespace: str, replicas: tuple[OperatorProcess, OperatorProcess]
) -> None:
    leader, standby = replicas
    stopped = time.monotonic()
    leader.stop(signal.SIGTERM)  # releases the Lease on its way out
    released_after = time.monotonic() - stopped
    eventually(lambda: holder(cluster, namespace) == "op-b", timeout=10, interval=0.1,
               message="op-b holds the released Lease")  # fmt: skip
    handed_over = time.monotonic() - stopped
    # One standby period (2 s) after the release, far less than a Lease's duration.
    assert handed_over - released_after <= LeaseTiming().renew_seconds + 1.0
    assert "released the leader Lease" in leader.output()
    # The webhooks stay registered: the standby still serves them.
    configuration = cluster.kubectl(
        "get", "mutatingwebhookconfiguration", standby.configuration, "-o", "json"
    )
    assert json.loads(configuration.stdout).get("webhooks")
    assert "Traceback" not in leader.output() + standby.output()
