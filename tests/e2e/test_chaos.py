"""A seeded fault matrix on the real node while the trainer publishes continuously.

Faults, drawn with `CHAOS_SEED`: an engine container killed (the kubelet restarts it in
place), an engine pod replaced, an engine frozen (SIGSTOP) for 2 x the round timeout, an
agent container killed, the operator killed and restarted, the API server stopped for a
few seconds and restarted, an engine pod cut off the network (nft in its namespace) for
2 x the round timeout. `CHAOS_FAULTS` of them (CI: 12, each kind once and 5 again; `make chaos`:
100), each followed by convergence: both engines Ready and serving the trainer's last
published version, bit-identical.

Watched the whole time, and asserted at the end:
* stale Ready: a pod Ready with its gate True whose engine serves a version older than
  the WeightSync's `currentVersion` read just before (gates are written before the
  status in each pass), or bytes that are not that version's: 0;
* `ok=True` rounds not bit-exact: after each, every engine reporting that version
  must serve exactly the trainer's bytes: 0;
* the largest overrun of a failed round past `transfer.timeoutSeconds`: at most 2 s.

The report (printed with `-s`) is what docs/reliability.md records.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.cluster.controlplane import LocalCluster
from tests.e2e.test_recovery import answers, in_group, no_tracebacks
from tests.support.eventually import eventually
from tests.support.kube import condition
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
from tests.support.recovery import (
    engine_digest,
    kill_container,
    partitioned,
    replace_pod,
    running_container,
)
from weightsync.controller import names

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

FAULTS = int(os.environ.get("CHAOS_FAULTS", "12"))  # CI: each kind once, 5 drawn again
SEED = int(os.environ.get("CHAOS_SEED", "15"))
TIMEOUT_SECONDS = 8  # transfer.timeoutSeconds: a frozen engine fails rounds fast
OVERRUN_LIMIT_SECONDS = 2.0
CONVERGE_SECONDS = 240.0
KINDS = (
    "engine_restart",
    "engine_replace",
    "engine_freeze",
    "agent_kill",
    "operator_kill",
    "apiserver_restart",
    "engine_partition",
)


@dataclass
class Report:
    rounds: list[dict[str, Any]] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    converge: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    stale_ready: list[tuple[str, Any, Any]] = field(default_factory=list)
    not_bit_exact: list[tuple[str, int]] = field(default_factory=list)
    engine_pods: set[str] = field(default_factory=set)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.rounds if r["ok"]]
        failed = [r for r in self.rounds if not r["ok"]]
        overrun = max((r["duration_seconds"] - TIMEOUT_SECONDS for r in failed), default=0.0)
        return {
            "seed": SEED,
            "rounds": len(self.rounds),
            "ok": len(ok),
            "failed": len(failed),
            "failed_reasons": sorted({r["reason"] for r in failed}),
            "faults": dict(self.faults),
            "converge_p50_max_seconds": {
                kind: (round(statistics.median(ts), 1), round(max(ts), 1))
                for kind, ts in self.converge.items()
            },
            "stale_ready": len(self.stale_ready),
            "ok_not_bit_exact": len(self.not_bit_exact),
            "max_overrun_seconds": round(max(overrun, 0.0), 2),
            "engine_pods_created": len(self.engine_pods),
        }


class Publisher(threading.Thread):
    """The trainer stepping continuously; each ok round checked bit-exact on the engines."""

    def __init__(self, cluster: LocalCluster, namespace: str, ip: str, report: Report) -> None:
        super().__init__(name="publisher", daemon=True)
        self.cluster, self.namespace, self.ip, self.report = cluster, namespace, ip, report
        self.published: dict[int, dict[str, Any]] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                result = step(self.ip)
                self.report.rounds.append(result)
                if result["ok"]:
                    digest = trainer_digest(self.ip)
                    self.published[digest["version"]] = digest
                    self._check(digest)
                time.sleep(0.3)
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def _check(self, digest: dict[str, Any]) -> None:
        # Rounds go on while the API server restarts; the check waits for it to list pods.
        engine_pods = eventually(
            lambda: pods(self.cluster, self.namespace, "engine"),
            timeout=60,
            interval=0.5,
            message="engine pods listed",
        )
        for pod in engine_pods:
            if not pod["status"].get("podIP"):
                continue  # a replacement not started yet
            try:
                served = engine_digest(pod, ENGINE_PORT)
            except OSError:
                continue  # being killed
            if served["version"] == digest["version"] and served != digest:
                self.report.not_bit_exact.append((pod["metadata"]["name"], digest["version"]))


class StaleWatch(threading.Thread):
    """Polls Ready engine pods against the WeightSync's currentVersion read just before."""

    def __init__(self, cluster: LocalCluster, namespace: str, publisher: Publisher) -> None:
        super().__init__(name="stale-watch", daemon=True)
        self.cluster, self.namespace, self.publisher = cluster, namespace, publisher
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            # The API server or a pod going away mid-look: look again.
            with contextlib.suppress(OSError, json.JSONDecodeError, RuntimeError):
                self._look()
            time.sleep(0.5)

    def _look(self) -> None:
        report = self.publisher.report
        current = sync_status(self.cluster, self.namespace).get("currentVersion")
        for pod in pods(self.cluster, self.namespace, "engine"):
            report.engine_pods.add(pod["metadata"]["name"])
            if current is None or not _ready_and_gated(pod):
                continue
            try:
                served = engine_digest(pod, ENGINE_PORT)
            except OSError:
                continue
            version = served["version"]
            whole = self.publisher.published.get(version)
            if version is not None and version >= current and (whole is None or whole == served):
                continue
            # Confirm: still Ready, same container, same answer (not a kill in between).
            again = next(
                (p for p in pods(self.cluster, self.namespace, "engine")
                 if p["metadata"]["name"] == pod["metadata"]["name"]),
                None,
            )  # fmt: skip
            if again is None or not _ready_and_gated(again):
                continue
            if _restarts(again) != _restarts(pod):
                continue
            report.stale_ready.append((pod["metadata"]["name"], version, current))


def _ready_and_gated(pod: dict[str, Any]) -> bool:
    """Ready with the weights-current gate True. The gate is what the operator writes (before
    the status, in each pass); Ready follows it once the kubelet has seen the change."""
    return condition(pod, "Ready") == "True" and condition(pod, names.WEIGHTS_CURRENT) == "True"


def _restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])


def inject(kind: str, cluster: LocalCluster, namespace: str, operator: OperatorProcess,
           rng: random.Random) -> None:  # fmt: skip
    victims = pods(cluster, namespace, "engine")
    victim = rng.choice(victims)
    if kind == "engine_restart":
        kill_container(cluster.node, victim, "engine")
    elif kind == "engine_replace":
        replace_pod(cluster, victim)
    elif kind == "engine_freeze":
        pid = int(str(running_container(cluster.node, victim, "engine")["pid"]))
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(2 * TIMEOUT_SECONDS)
        finally:
            os.kill(pid, signal.SIGCONT)
    elif kind == "agent_kill":
        kill_container(cluster.node, victim, names.AGENT_CONTAINER)
    elif kind == "operator_kill":
        operator.stop(signal.SIGKILL)
        time.sleep(rng.uniform(1.0, 5.0))
        operator.start()
    elif kind == "apiserver_restart":
        cluster.restart_apiserver(down_seconds=rng.uniform(1.0, 5.0))
    elif kind == "engine_partition":
        with partitioned(cluster.node, victim, "engine"):
            time.sleep(2 * TIMEOUT_SECONDS)
    else:
        raise ValueError(kind)


def schedule(rng: random.Random, count: int) -> list[str]:
    """`count` faults: seeded permutations of every kind, one after another, so any run
    of len(KINDS) faults injects each kind once."""
    order: list[str] = []
    while len(order) < count:
        order += rng.sample(KINDS, len(KINDS))
    return order[:count]


def converged(cluster: LocalCluster, namespace: str, publisher: Publisher) -> bool:
    if not publisher.published:
        return False
    latest = publisher.published[max(publisher.published)]
    serving = ready(cluster, namespace, "engine", 2)
    if not serving:
        return False
    try:
        return all(engine_digest(p, ENGINE_PORT) == latest for p in serving)
    except OSError:
        return False


def test_fault_matrix(cluster: LocalCluster, namespace: str, operator: OperatorProcess) -> None:
    sync = weightsync()
    sync["spec"]["recovery"] = {"protocol": "TCP", "holders": 1}
    sync["spec"]["transfer"]["timeoutSeconds"] = TIMEOUT_SECONDS
    apply(cluster, namespace, trainer(), engines(replicas=2), sync)
    eventually(lambda: in_group(cluster, namespace, 3), timeout=PODS_UP, message="group warm")
    (source,) = pods(cluster, namespace, "trainer")
    ip = source["status"]["podIP"]
    url = f"http://{ip}:{TRAINER_PORT}/digest"
    eventually(lambda: answers(url), timeout=PODS_UP, message="trainer serving")

    report = Report()
    publisher = Publisher(cluster, namespace, ip, report)
    watch = StaleWatch(cluster, namespace, publisher)
    publisher.start()
    watch.start()
    rng = random.Random(SEED)
    try:
        eventually(lambda: converged(cluster, namespace, publisher), timeout=CONVERGE_SECONDS,
                   message="synced before the first fault")  # fmt: skip
        for kind in schedule(rng, FAULTS):
            started = time.monotonic()
            inject(kind, cluster, namespace, operator, rng)
            report.faults[kind] += 1
            time.sleep(2.0)  # let the fault be seen before asking for convergence
            eventually(
                lambda: converged(cluster, namespace, publisher),
                timeout=CONVERGE_SECONDS,
                interval=0.5,
                message=f"converged after {kind}",
            )
            report.converge[kind].append(time.monotonic() - started)
            assert publisher.error is None, publisher.error
            time.sleep(rng.uniform(0.0, 3.0))
    finally:
        publisher.stop.set()
        watch.stop.set()
        publisher.join(timeout=120)
        watch.join(timeout=30)
    summary = report.summary()
    print("chaos report:", json.dumps(summary, sort_keys=True))  # docs/reliability.md
    assert publisher.error is None, publisher.error
    assert report.stale_ready == [], report.stale_ready
    assert report.not_bit_exact == [], report.not_bit_exact
    assert summary["max_overrun_seconds"] <= OVERRUN_LIMIT_SECONDS, summary
    assert summary["ok"] > FAULTS, summary
    no_tracebacks(cluster, operator, namespace)
