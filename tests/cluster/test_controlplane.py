"""The local control plane behaves like a cluster: scheduling, replacement, webhooks.

KWOK's fake GPU nodes here; the real node's own behaviour is in test_realnode.py.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.cluster import kwok_stages
from tests.cluster.controlplane import LocalCluster, free_port
from tests.cluster.node.realnode import GPU_DRIVER, NODE_NAME
from tests.cluster.pki import CertificateAuthority
from tests.support.eventually import Timeouts, eventually
from tests.support.kube import condition, deployment, watch_pods_until

pytestmark = pytest.mark.cluster


def apply(cluster: LocalCluster, namespace: str, *objects: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))


def ready(pod: dict[str, Any]) -> bool:
    return condition(pod, "Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def test_deployment_pods_become_ready_on_kwok_nodes_with_loopback_ips(
    cluster: LocalCluster, namespace: str, k8s: client.ApiClient
) -> None:
    apply(cluster, namespace, deployment("plain", replicas=3))
    core = client.CoreV1Api(k8s)

    def three_ready() -> list[Any] | None:
        pods = [
            p
            for p in core.list_namespaced_pod(namespace).items
            if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        ]
        return pods if len(pods) == 3 else None

    pods = eventually(three_ready, timeout=Timeouts.POD_READY, message="3 Ready pods")
    for pod in pods:
        assert pod.spec.node_name.startswith("gpu-node-")
        assert pod.status.pod_ip.startswith(f"127.{cluster.pod_octet}."), pod.status.pod_ip

    def gpus() -> dict[str, str]:
        nodes = client.CoreV1Api(k8s).list_node().items
        return {n.metadata.name: n.status.allocatable.get("nvidia.com/gpu") for n in nodes}

    # KWOK's nodes advertise GPUs as an extended resource (for the scheduler only); the
    # real node's come from its DRA driver, as devices in a ResourceSlice.
    kwok = {name: count for name, count in gpus().items() if name.startswith("gpu-node-")}
    assert kwok, gpus()
    assert set(kwok.values()) == {"4"}, kwok
    slices = json.loads(cluster.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
    (node_slice,) = [s for s in slices if s["spec"].get("nodeName") == NODE_NAME]
    assert node_slice["spec"]["driver"] == GPU_DRIVER
    assert sorted(d["name"] for d in node_slice["spec"]["devices"]) == [
        "gpu-0", "gpu-1", "gpu-2", "gpu-3"
    ]  # fmt: skip


def test_deleted_pod_is_replaced(
    cluster: LocalCluster, namespace: str, k8s: client.ApiClient
) -> None:
    apply(cluster, namespace, deployment("replaced"))
    first = watch_pods_until(k8s, namespace, lambda _, p: ready(p), timeout=Timeouts.POD_READY)
    cluster.kubectl("delete", "pod", "-n", namespace, first["metadata"]["name"], "--wait=false")
    second = watch_pods_until(
        k8s,
        namespace,
        lambda _, p: ready(p) and p["metadata"]["uid"] != first["metadata"]["uid"],
        timeout=Timeouts.POD_REPLACED,
    )
    assert second["metadata"]["name"] != first["metadata"]["name"]


def test_crash_loop_stage_holds_pod_not_ready(
    cluster: LocalCluster, namespace: str, k8s: client.ApiClient
) -> None:
    apply(cluster, namespace, deployment("looping"))
    pod = watch_pods_until(k8s, namespace, lambda _, p: ready(p), timeout=Timeouts.POD_READY)
    name = pod["metadata"]["name"]
    cluster.kubectl("label", "pod", "-n", namespace, name, f"{kwok_stages.CRASH_LOOP_LABEL}=true")
    looping = watch_pods_until(
        k8s,
        namespace,
        lambda _, p: p["metadata"]["name"] == name and condition(p, "Ready") == "False",
        timeout=Timeouts.API,
    )
    waiting = looping["status"]["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == "CrashLoopBackOff"
    assert looping["status"]["phase"] == "Running"


class _Webhook(BaseHTTPRequestHandler):
    """Admits every pod, adding a label so the test sees the API server called it."""

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        patch = [{"op": "add", "path": "/metadata/labels", "value": {"webhook-called": "yes"}}]
        body = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": review["request"]["uid"],
                "allowed": True,
                "patchType": "JSONPatch",
                "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
            },
        }
        payload = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def webhook_server(cluster: LocalCluster) -> Iterator[ThreadingHTTPServer]:
    ca = CertificateAuthority(cluster.pki_dir)
    cert, key = ca.issue("test-webhook", "test-webhook", ip_addresses=("127.0.0.1",), server=True)
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Webhook)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_api_server_calls_tls_webhook_by_url_and_fails_closed_without_it(
    cluster: LocalCluster, namespace: str, webhook_server: ThreadingHTTPServer
) -> None:
    port = webhook_server.server_address[1]
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": f"test-{namespace}"},
        "webhooks": [
            {
                "name": "label.test.weightsync.io",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{port}/mutate",
                    "caBundle": base64.b64encode(
                        (cluster.pki_dir / "ca.crt").read_bytes()
                    ).decode(),
                },
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }
        ],
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(config))
    try:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "called"},
            "spec": {"containers": [{"name": "main", "image": "busybox:1.36"}]},
        }
        apply(cluster, namespace, pod)
        labels = json.loads(
            cluster.kubectl("get", "pod", "called", "-n", namespace, "-o", "json").stdout
        )["metadata"]["labels"]
        assert labels == {"webhook-called": "yes"}

        webhook_server.shutdown()
        webhook_server.server_close()
        pod["metadata"]["name"] = "refused"
        result = cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(pod), check=False
        )
        assert result.returncode != 0
        assert "failed calling webhook" in result.stderr
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", f"test-{namespace}", check=False)
