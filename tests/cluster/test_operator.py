"""The operator end to end on the local control plane, with real agents, engines and a trainer.

The operator runs as its own process (`weightsync-operator`, URL-mode webhook on
127.0.0.1, certificates it generates itself); the API server calls its webhooks over
TLS; trainer and inference pods run as pod-runner processes (the reference trainer,
reference engines, and the injected `weightsync-agent` sidecars), so every round is a
real gloo broadcast driven by a real Publisher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import kwok_stages
from tests.cluster.controlplane import LocalCluster, free_port
from tests.support.eventually import Timeouts, eventually
from tests.support.kube import condition
from weightsync.api import reasons
from weightsync.controller import names
from weightsync.controller.workloads import parse_time

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = REPO_ROOT / "crds" / "weightsync.io_weightsyncs.yaml"
OPERATOR = Path(sys.executable).parent / "weightsync-operator"
TRAINER_PORT = 8080
ENGINE_PORT = 8000
RESYNC_SECONDS = 1
# Torch-importing processes (agents, engines, the trainer) start slowly on two shared cores.
PODS_UP = 120.0


class OperatorProcess:
    """`weightsync-operator --namespace <ns>` as a local process, webhook in URL mode."""

    def __init__(self, cluster: LocalCluster, namespace: str, workdir: Path) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.log = workdir / "operator.log"
        self.configuration = f"{namespace}.weightsync.io"
        port = free_port()
        self.health_port = free_port()
        self.metrics_port = free_port()
        self.env = {
            **os.environ,
            "KUBECONFIG": str(cluster.kubeconfig),
            "WEIGHTSYNC_OPERATOR_NAMESPACE": namespace,
            "WEIGHTSYNC_OPERATOR_WEBHOOK_URL": f"https://127.0.0.1:{port}",
            "WEIGHTSYNC_OPERATOR_WEBHOOK_LISTEN_HOST": "127.0.0.1",
            "WEIGHTSYNC_OPERATOR_WEBHOOK_LISTEN_PORT": str(port),
            "WEIGHTSYNC_OPERATOR_WEBHOOK_CONFIGURATION": self.configuration,
            "WEIGHTSYNC_OPERATOR_HEALTH_PORT": str(self.health_port),
            "WEIGHTSYNC_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "WEIGHTSYNC_OPERATOR_RESYNC_SECONDS": str(RESYNC_SECONDS),
            "WEIGHTSYNC_OPERATOR_MISSING_REFERENCE_RETRY_SECONDS": "2",
            "WEIGHTSYNC_OPERATOR_RENDEZVOUS_PORT": str(free_port()),
        }
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as output:
            self.popen = subprocess.Popen(
                [str(OPERATOR), "--namespace", self.namespace],
                env=self.env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        eventually(self._serving, timeout=Timeouts.WEBHOOK, message="operator serving")

    def _serving(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"the operator exited:\n{self.output()[-3000:]}")
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        with urllib.request.urlopen(url, timeout=2) as reply:
            if reply.status != 200:
                return False
        result = self.cluster.kubectl(
            "get", "mutatingwebhookconfiguration", self.configuration, "-o", "json", check=False
        )
        return result.returncode == 0 and bool(json.loads(result.stdout).get("webhooks"))

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, sig)
        self.popen.wait(timeout=60)

    def passes(self) -> float:
        """Successful reconcile passes this process has made (its own metrics)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "weightsync_operator_reconciles_total" and sample.labels == {
                    "result": "ok"
                }:
                    return float(sample.value)
        return 0.0

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def delete_configurations(self) -> None:
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            self.cluster.kubectl("delete", kind, self.configuration, "--ignore-not-found")


@pytest.fixture(scope="module")
def crd(cluster: LocalCluster) -> LocalCluster:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "crd/weightsyncs.weightsync.io")
    eventually(
        lambda: cluster.kubectl("get", "wsync", "-A", check=False).returncode == 0,
        timeout=Timeouts.API,
        message="kubectl get wsync resolves",
    )
    return cluster


@pytest.fixture
def operator(crd: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess(crd, namespace, tmp_path)
    process.start()
    try:
        yield process
    finally:
        # WeightSyncs carry the operator's finalizer: delete them while it still runs.
        if process.popen is not None and process.popen.poll() is None:
            crd.kubectl(
                "delete", "weightsyncs", "--all", "-n", namespace, "--timeout=30s", check=False
            )
        else:  # a test killed it: the namespace must still go away
            for name in crd.kubectl(
                "get", "weightsyncs", "-n", namespace, "-o", "name", check=False
            ).stdout.split():
                crd.kubectl(
                    "patch", name, "-n", namespace, "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}', check=False,
                )  # fmt: skip
        process.stop()
        # A killed operator leaves its webhooks registered; other tests must not meet them.
        process.delete_configurations()
        sys.stderr.write(process.output()[-4000:])


# -- manifests -------------------------------------------------------------------------

POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def template(
    app: str, containers: list[dict[str, Any]], *, inject: bool, local: bool
) -> dict[str, Any]:
    labels = {"app": app}
    if inject:
        labels[names.INJECT_LABEL] = names.INJECT_VALUE
    annotations = {kwok_stages.RUN_LOCAL: "true"} if local else {}
    return {
        "metadata": {"labels": labels, "annotations": annotations},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 1},
    }


def trainer(name: str = "trainer", *, inject: bool = True, local: bool = True) -> dict[str, Any]:
    container = {
        "name": "trainer",
        "image": "weightsync/reference-trainer",
        "command": ["python", "-m", "weightsync.engines.reference.trainer", "--host", "$(POD_IP)",
                    "--port", str(TRAINER_PORT), "--interval", "0"],
        "env": [POD_IP_ENV],
    }  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": template(name, [container], inject=inject, local=local),
        },
    }


def engines(
    name: str = "engine", replicas: int = 2, *, inject: bool = True, local: bool = True
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "engine", "image": "weightsync/reference-engine"}
    if local:
        container |= {
            "command": ["weightsync-reference-engine", "--host", "$(POD_IP)",
                        "--port", str(ENGINE_PORT), "--preset", "tiny"],
            "env": [POD_IP_ENV],
            "readinessProbe": {"httpGet": {"path": "/health", "port": ENGINE_PORT}},
        }  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": template(name, [container], inject=inject, local=local),
        },
    }


def weightsync(
    name: str = "sync", trainer: str = "trainer", deployment: str = "engine"
) -> dict[str, Any]:
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": name},
        "spec": {
            "trainer": {"statefulSetRef": {"name": trainer}},
            "inference": [
                {"deploymentRef": {"name": deployment}, "engine": "Reference", "port": ENGINE_PORT}
            ],
            "transfer": {"bucketSizeBytes": 1 << 20, "timeoutSeconds": 30},
            "prewarm": {"timeoutSeconds": 60},
            "recovery": {"protocol": "TCP"},
        },
    }


# -- reading the cluster ---------------------------------------------------------------


def apply(cluster: LocalCluster, namespace: str, *objects: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))


def get(cluster: LocalCluster, namespace: str, *what: str) -> Any:
    return json.loads(cluster.kubectl("get", "-n", namespace, *what, "-o", "json").stdout)


def pods(cluster: LocalCluster, namespace: str, app: str) -> list[dict[str, Any]]:
    items = get(cluster, namespace, "pods", "-l", f"app={app}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def has_sidecar(pod: dict[str, Any]) -> bool:
    containers = pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
    return any(c["name"] == names.AGENT_CONTAINER for c in containers)


def sync_status(cluster: LocalCluster, namespace: str, name: str = "sync") -> dict[str, Any]:
    status: dict[str, Any] = get(cluster, namespace, "weightsync", name).get("status") or {}
    return status


def reason(status: dict[str, Any], kind: str) -> tuple[str, str] | None:
    for item in status.get("conditions") or []:
        if item["type"] == kind:
            return item["status"], item["reason"]
    return None


def step(trainer_ip: str) -> dict[str, Any]:
    """One optimizer step + publish on the trainer; the Publisher's result."""
    request = urllib.request.Request(f"http://{trainer_ip}:{TRAINER_PORT}/step", method="POST")
    with urllib.request.urlopen(request, timeout=Timeouts.ROUND) as reply:  # noqa: S310
        result: dict[str, Any] = json.loads(reply.read())
    return result


def gates(cluster: LocalCluster, namespace: str) -> dict[str, tuple[str | None, str | None]]:
    """Each engine pod's (weights-current, Ready) condition status."""
    return {
        p["metadata"]["name"]: (condition(p, names.WEIGHTS_CURRENT), condition(p, "Ready"))
        for p in pods(cluster, namespace, "engine")
    }


def events(cluster: LocalCluster, namespace: str) -> list[tuple[str, str]]:
    items = get(cluster, namespace, "events", "--field-selector", "involvedObject.kind=WeightSync")
    return [(e["type"], e["reason"]) for e in items["items"]]


# -- the tests -------------------------------------------------------------------------


@pytest.mark.timeout(900)
def test_injection_prewarm_rounds_scaling_restart_and_deletion(
    operator: OperatorProcess, namespace: str
) -> None:
    cluster = operator.cluster
    apply(cluster, namespace, weightsync())
    apply(cluster, namespace, trainer(), engines(replicas=2))

    # The API server called the webhook: every selected pod carries the sidecar, and the
    # inference pods the readiness gate, which holds them NotReady before any version.
    def group_of(count: int) -> dict[str, Any] | None:
        status = sync_status(cluster, namespace)
        members = status.get("members") or []
        warm = reason(status, "Prewarmed") == ("True", reasons.GROUP_WARM)
        return status if len(members) == count and warm else None

    status = eventually(lambda: group_of(3), timeout=PODS_UP, interval=1, message="3 warm ranks")
    trainer_pod = pods(cluster, namespace, "trainer")[0]
    engine_pods = pods(cluster, namespace, "engine")
    assert all(has_sidecar(p) for p in [trainer_pod, *engine_pods])
    for pod in engine_pods:
        assert pod["spec"]["readinessGates"] == [{"conditionType": names.WEIGHTS_CURRENT}]
        assert pod["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "sync"
    assert [(m["rank"], m["role"]) for m in status["members"]] == [
        (0, "Source"), (1, "Sink"), (2, "Sink"),
    ]  # fmt: skip
    assert status["members"][0]["pod"] == "trainer-0"
    assert reason(status, "Ready") == ("True", reasons.AWAITING_FIRST_VERSION)
    assert "currentVersion" not in status  # warm before the trainer's first publish
    assert all(g == ("False", "False") for g in gates(cluster, namespace).values())

    # A round: every inference pod serves version 1, its gate opens, and kubectl shows it.
    trainer_ip = trainer_pod["status"]["podIP"]
    first = step(trainer_ip)
    assert first["ok"], first
    assert first["generation"] == status["groupGeneration"]
    eventually(
        lambda: all(g == ("True", "True") for g in gates(cluster, namespace).values()),
        timeout=Timeouts.API, message="gates open after the first round",
    )  # fmt: skip
    table = cluster.kubectl("get", "wsync", "-n", namespace, "sync").stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "READY", "VERSION", "MEMBERS"]
    assert table[1].split()[:4] == ["sync", "True", "1", "3"]

    # Scale 2 -> 4 while training: the newcomers are warmed in a new generation in the
    # background and join at a round boundary; no round fails meanwhile.
    before = status["groupGeneration"]
    cluster.kubectl("scale", "deployment", "engine", "-n", namespace, "--replicas=4")
    results = [first]
    deadline = time.monotonic() + PODS_UP
    while time.monotonic() < deadline:
        results.append(step(trainer_ip))
        status = sync_status(cluster, namespace)
        latest = results[-1]["version"]
        if (
            len(status.get("members") or []) == 5
            and status.get("currentVersion") == latest
            and results[-1]["generation"] == status["groupGeneration"]
            and all(m.get("version") == latest for m in status["members"])
        ):
            break
        time.sleep(1)
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    assert status["groupGeneration"] > before
    assert len(status["members"]) == 5
    eventually(
        lambda: len(gates(cluster, namespace)) == 4
        and all(g == ("True", "True") for g in gates(cluster, namespace).values()),
        timeout=Timeouts.API, message="all four engines serve the current version",
    )  # fmt: skip

    # Restarting the operator between rounds changes nothing.
    settled = sync_status(cluster, namespace)
    operator.stop()
    operator.start()
    eventually(
        lambda: operator.passes() >= 3, timeout=Timeouts.API, message="3 passes after restart"
    )
    again = sync_status(cluster, namespace)
    for key in ("groupGeneration", "members", "currentVersion", "lastRound", "conditions"):
        assert again[key] == settled[key], key
    result = step(trainer_ip)
    assert result["ok"], result
    assert result["generation"] == settled["groupGeneration"]

    # A spec change the agents only learn from a plan (transfer options) re-plans the group.
    cluster.kubectl(
        "patch", "weightsync", "sync", "-n", namespace, "--type=merge",
        "-p", '{"spec": {"transfer": {"timeoutSeconds": 45}}}',
    )  # fmt: skip

    def replanned_group() -> dict[str, Any] | None:
        group = group_of(5)
        newer = group is not None and group["groupGeneration"] > settled["groupGeneration"]
        return group if newer else None

    replanned = eventually(
        replanned_group, timeout=Timeouts.API, message="a new warm generation after the change"
    )
    result = step(trainer_ip)
    assert result["ok"], result
    assert result["generation"] == replanned["groupGeneration"]

    # Deleting the WeightSync releases the gates and leaves nothing behind.
    cluster.kubectl("delete", "weightsync", "sync", "-n", namespace, "--timeout=60s")
    secret = names.token_secret_name("sync")
    eventually(
        lambda: cluster.kubectl("get", "secret", secret, "-n", namespace, check=False).returncode
        != 0,
        timeout=Timeouts.API, message="token Secret garbage-collected",
    )  # fmt: skip
    assert all(g[0] == "True" for g in gates(cluster, namespace).values())
    leftovers = cluster.kubectl(
        "get", "secrets,configmaps,services", "-n", namespace, "-l", f"{names.SYNC_LABEL}=sync",
        "-o", "name",
    ).stdout.strip()  # fmt: skip
    assert leftovers == ""
    assert ("Normal", "GenerationPlanned") in events(cluster, namespace)
    assert "Traceback" not in operator.output()


def ready(cluster: LocalCluster, namespace: str, app: str, count: int) -> list[dict[str, Any]]:
    found = [p for p in pods(cluster, namespace, app) if condition(p, "Ready") == "True"]
    return found if len(found) == count else []


@pytest.mark.timeout(300)
def test_unrelated_pods_are_never_mutated_and_schedule_while_the_operator_is_down(
    operator: OperatorProcess, namespace: str
) -> None:
    cluster = operator.cluster
    # KWOK plays these pods (no processes): admission and scheduling are what is tested.
    apply(cluster, namespace, weightsync(), trainer(local=False))
    apply(cluster, namespace, engines("plain", replicas=1, inject=False, local=False))
    (plain,) = eventually(
        lambda: ready(cluster, namespace, "plain", 1), timeout=Timeouts.POD_READY, message="plain"
    )
    assert not has_sidecar(plain)
    assert not any(k.startswith("weightsync.io/") for k in plain["metadata"].get("annotations", {}))
    assert "readinessGates" not in plain["spec"]
    assert has_sidecar(pods(cluster, namespace, "trainer")[0])

    # Pods from the WeightSync's own second count as applied together with it (and would
    # be recreated); the pods below must be clearly newer.
    created = parse_time(
        get(cluster, namespace, "weightsync", "sync")["metadata"]["creationTimestamp"]
    )
    assert created is not None
    eventually(
        lambda: datetime.now(UTC) >= created + timedelta(seconds=1.2),
        timeout=Timeouts.API, message="a second past the WeightSync",
    )  # fmt: skip

    # A hard kill leaves the webhooks registered, pointing at nothing.
    operator.stop(signal.SIGKILL)
    (pod_hook,) = get(cluster, "default", "mutatingwebhookconfiguration", operator.configuration)[
        "webhooks"
    ]
    assert pod_hook["failurePolicy"] == "Ignore"
    assert pod_hook["objectSelector"] == {
        "matchExpressions": [
            {"key": names.INJECT_LABEL, "operator": "In", "values": [names.INJECT_VALUE]}
        ]
    }
    assert pod_hook["rules"][0]["operations"] == ["CREATE"]
    (claims_hook,) = get(
        cluster, "default", "validatingwebhookconfiguration", operator.configuration
    )["webhooks"]
    assert claims_hook["failurePolicy"] == "Fail"
    assert claims_hook["rules"][0]["resources"] == ["weightsyncs"]
    started = time.monotonic()
    apply(
        cluster,
        namespace,
        engines("plain-2", replicas=1, inject=False, local=False),
        engines("engine", replicas=1, inject=True, local=False),
    )
    (unrelated,) = eventually(
        lambda: ready(cluster, namespace, "plain-2", 1),
        timeout=Timeouts.POD_READY,
        message="plain-2",
    )
    # The API server never called the dead webhook for it: no 30 s admission timeout.
    assert time.monotonic() - started < 20
    assert not has_sidecar(unrelated)
    # A labelled pod is admitted too (failurePolicy Ignore), without the sidecar...
    (bare,) = eventually(
        lambda: ready(cluster, namespace, "engine", 1), timeout=Timeouts.POD_READY, message="engine"
    )
    assert not has_sidecar(bare)

    # ...and once the operator is back, the WeightSync says so.
    operator.start()

    def flagged() -> bool:
        degraded = reason(sync_status(cluster, namespace), "Degraded")
        return degraded == ("True", "SidecarMissing")

    eventually(flagged, timeout=Timeouts.API, message="Degraded=True SidecarMissing")
    degraded = next(
        c for c in sync_status(cluster, namespace)["conditions"] if c["type"] == "Degraded"
    )
    assert bare["metadata"]["name"] in degraded["message"]
    assert ("Warning", "SidecarMissing") in events(cluster, namespace)
    assert "Traceback" not in operator.output()


@pytest.mark.timeout(180)
def test_invalid_references_and_claimed_workloads_are_reported_not_crashed_on(
    operator: OperatorProcess, namespace: str
) -> None:
    cluster = operator.cluster
    apply(cluster, namespace, weightsync())

    def ready_reason() -> str | None:
        found = reason(sync_status(cluster, namespace), "Ready")
        return found[1] if found and found[0] == "False" else None

    assert eventually(ready_reason, timeout=Timeouts.API) == reasons.TRAINER_NOT_FOUND
    # Level-based: creating the StatefulSet moves the reason on without touching the spec.
    apply(cluster, namespace, trainer(inject=False, local=False))
    eventually(
        lambda: ready_reason() == reasons.DEPLOYMENT_NOT_FOUND,
        timeout=Timeouts.API, message="Ready=False DeploymentNotFound",
    )  # fmt: skip
    warnings = {r for t, r in events(cluster, namespace) if t == "Warning"}
    assert {reasons.TRAINER_NOT_FOUND, reasons.DEPLOYMENT_NOT_FOUND} <= warnings

    # The validating webhook refuses a second WeightSync for the same workloads.
    second = weightsync("second")
    refused = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(second), check=False
    )
    assert refused.returncode != 0
    assert "is already synced by WeightSync sync" in refused.stderr
    assert operator.popen is not None
    assert operator.popen.poll() is None  # still running: no crash loop
    assert "Traceback" not in operator.output()
