"""Shared parts of the operator's cluster tests: the operator as a process, manifests, reads.

No tests here. The operator runs as its own process (`weightsync-operator`, URL-mode
webhook on 127.0.0.1, certificates it generates itself), serving only the test's
namespace; its fixture deletes the test's WeightSyncs while it still runs (they carry
its finalizer) and removes its webhook configurations even if a test killed it.

Workloads that run (`local=True`) are containers on the cluster's real node, from the
images `.ci/setup` builds (the reference engine's image runs the trainer too); the
others only need scheduling and land on the KWOK nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.controlplane import LocalCluster, free_port
from tests.cluster.images import SPECS
from tests.cluster.node.realnode import NODE_LABEL
from tests.support.eventually import Timeouts, eventually
from tests.support.kube import condition
from weightsync.controller import names

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

    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        workdir: Path,
        overrides: Mapping[str, str | None] | None = None,
    ) -> None:
        """`overrides`: settings to change (None: leave the operator's default)."""
        self.cluster = cluster
        self.namespace = namespace
        self.log = workdir / "operator.log"
        self.configuration = f"{namespace}.weightsync.io"
        port = free_port()
        self.health_port = free_port()
        self.metrics_port = free_port()
        # The operator's temp files (its webhook key) stay under the test's directory.
        (workdir / "tmp").mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "TMPDIR": str(workdir / "tmp"),
            "KUBECONFIG": str(cluster.kubeconfig),
            "WEIGHTSYNC_OPERATOR_NAMESPACE": namespace,
            "WEIGHTSYNC_OPERATOR_WEBHOOK_URL": f"https://127.0.0.1:{port}",
            "WEIGHTSYNC_OPERATOR_WEBHOOK_LISTEN_HOST": "127.0.0.1",
            "WEIGHTSYNC_OPERATOR_WEBHOOK_LISTEN_PORT": str(port),
            "WEIGHTSYNC_OPERATOR_WEBHOOK_CONFIGURATION": self.configuration,
            "WEIGHTSYNC_OPERATOR_HEALTH_PORT": str(self.health_port),
            "WEIGHTSYNC_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "WEIGHTSYNC_OPERATOR_RESYNC_SECONDS": str(RESYNC_SECONDS),
            "WEIGHTSYNC_OPERATOR_RENDEZVOUS_PORT": str(free_port()),
            # The images are imported into the node; nothing can be pulled.
            "WEIGHTSYNC_OPERATOR_AGENT_IMAGE": SPECS["agent"].ref,
            "WEIGHTSYNC_OPERATOR_AGENT_IMAGE_PULL_POLICY": "Never",
            # One 2-core node runs every pod: the default 500m per sidecar would not fit.
            "WEIGHTSYNC_OPERATOR_AGENT_CPU_REQUEST": "10m",
            "WEIGHTSYNC_OPERATOR_AGENT_MEMORY_REQUEST": "64Mi",
        }
        for key, value in (overrides or {}).items():
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.create_configurations()
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

    def task_dump(self) -> str:
        """Where each of the operator's asyncio tasks is suspended (`taskdump`, SIGUSR1)."""
        if self.popen is None or self.popen.poll() is not None:
            return "(the operator is not running)"
        before = len(self.output())
        os.kill(self.popen.pid, signal.SIGUSR1)
        time.sleep(1.0)  # the loop logs it on its next turn
        return self.output()[before:]

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def create_configurations(self) -> None:
        """The two webhook configurations, without webhooks, as the chart creates them:
        the operator only patches its webhooks into them."""
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            body = {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": self.configuration},
            }
            self.cluster.kubectl("apply", "-f", "-", input=json.dumps(body))

    def delete_configurations(self) -> None:
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            self.cluster.kubectl("delete", kind, self.configuration, "--ignore-not-found")


# Fixtures named explicitly: test modules import the functions, and a parameter named
# like an imported function would shadow it.
@pytest.fixture(scope="module", name="crd")
def crd_installed(cluster: LocalCluster, images: dict[str, str]) -> LocalCluster:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "crd/weightsyncs.weightsync.io")
    eventually(
        lambda: cluster.kubectl("get", "wsync", "-A", check=False).returncode == 0,
        timeout=Timeouts.API,
        message="kubectl get wsync resolves",
    )
    return cluster


@pytest.fixture(name="operator")
def operator_process(
    crd: LocalCluster, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
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


ENGINE_IMAGE = SPECS["reference-engine"].ref
REAL_NODE = {NODE_LABEL: "true"}
KWOK_NODES = {"type": "kwok"}


def template(
    app: str, containers: list[dict[str, Any]], *, inject: bool, local: bool
) -> dict[str, Any]:
    """A pod template: on the real node if `local` (its containers run), else on KWOK's."""
    labels = {"app": app}
    if inject:
        labels[names.INJECT_LABEL] = names.INJECT_VALUE
    return {
        "metadata": {"labels": labels},
        "spec": {
            "containers": containers,
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": REAL_NODE if local else KWOK_NODES,
        },
    }


def trainer(
    name: str = "trainer", *, inject: bool = True, local: bool = True, preset: str = "tiny"
) -> dict[str, Any]:
    container = {
        "name": "trainer",
        "image": ENGINE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["python", "-m", "weightsync.reference.trainer", "--host", "$(POD_IP)",
                    "--port", str(TRAINER_PORT), "--interval", "0", "--preset", preset],
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
    name: str = "engine",
    replicas: int = 2,
    *,
    inject: bool = True,
    local: bool = True,
    preset: str = "tiny",
    bucket_delay_seconds: float = 0.0,
) -> dict[str, Any]:
    """A Deployment of reference engines; `bucket_delay_seconds` slows each bucket's load
    (rounds and recoveries) so a test can act while one runs."""
    container: dict[str, Any] = {
        "name": "engine",
        "image": ENGINE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["weightsync-reference-engine", "--host", "$(POD_IP)",
                    "--port", str(ENGINE_PORT), "--preset", preset,
                    "--load-delay-seconds", str(bucket_delay_seconds)],
        "env": [POD_IP_ENV],
        "readinessProbe": {"httpGet": {"path": "/health", "port": ENGINE_PORT},
                           "periodSeconds": 2},
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


def trainer_digest(trainer_ip: str) -> dict[str, Any]:
    """The reference trainer's weights: version and per-tensor digests (as an engine's)."""
    url = f"http://{trainer_ip}:{TRAINER_PORT}/digest"
    with urllib.request.urlopen(url, timeout=Timeouts.ROUND) as reply:
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


def ready(cluster: LocalCluster, namespace: str, app: str, count: int) -> list[dict[str, Any]]:
    found = [p for p in pods(cluster, namespace, app) if condition(p, "Ready") == "True"]
    return found if len(found) == count else []
