"""The local cluster's real node behaves as a kubelet node does for weightsync.

Pods are containers from a local image, each in its own network namespace with its own
/dev/shm; a killed container restarts in place; readiness gates gate a Service's
EndpointSlices; pods reach the API server through the `kubernetes` Service; `down`
leaves the machine as it found it, while another cluster runs beside it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controlplane import CACHE_DIR, LocalCluster, build_binaries
from tests.cluster.node import host
from tests.cluster.node.testimage import REF, busybox_archive
from tests.support.eventually import Timeouts, eventually

pytestmark = pytest.mark.node

GATE = "example.com/released"


@pytest.fixture(scope="module")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        state_dir=tmp_path_factory.mktemp("realnode"),
        bin_dir=build_binaries(),
        nodes=0,
        real_node=True,
    )
    cluster.up()
    try:
        cluster.node.import_archive(busybox_archive(CACHE_DIR))
        yield cluster
    finally:
        cluster.down()


def apply(cluster: LocalCluster, manifest: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def get(cluster: LocalCluster, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return result


def busybox_pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": REF,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", script],
                    **spec.pop("container", {}),
                }
            ],
            **spec,
        },
    }


def running(cluster: LocalCluster, name: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pod = get(cluster, "pod", name)
        statuses = pod["status"].get("containerStatuses") or [{}]
        return pod if statuses[0].get("state", {}).get("running") else None

    return eventually(ready, timeout=Timeouts.POD_READY, interval=0.5, message=f"{name} running")


def http_pod(name: str, **spec: Any) -> dict[str, Any]:
    script = "mkdir -p /www && hostname > /www/name && exec httpd -f -p 8080 -h /www"
    probe = {"httpGet": {"path": "/name", "port": 8080}, "periodSeconds": 1}
    return busybox_pod(name, script, container={"readinessProbe": probe}, **spec)


def test_pod_ip_reaches_host_and_api_server(node_cluster: LocalCluster) -> None:
    token = "$(cat /var/run/secrets/kubernetes.io/serviceaccount/token)"
    script = (
        'wget -qO- --no-check-certificate --header "Authorization: Bearer '
        f'{token}" https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/version'
        " > /tmp/version && mkdir -p /www && hostname > /www/name"
        " && exec httpd -f -p 8080 -h /www"
    )
    apply(node_cluster, busybox_pod("reach", script))
    pod = running(node_cluster, "reach")
    ip = pod["status"]["podIP"]
    assert ip.startswith(node_cluster.node.network.pod_cidr.rsplit(".", 2)[0])

    def fetch() -> str:
        with urllib.request.urlopen(f"http://{ip}:8080/name", timeout=2) as reply:
            return str(reply.read().decode())

    body = eventually(fetch, timeout=Timeouts.POD_READY, message="the pod's server from the host")
    assert body.strip() == "reach"
    version = node_cluster.kubectl("exec", "reach", "--", "cat", "/tmp/version").stdout
    built = (Path(__file__).parent / "build" / "build.sh").read_text()
    assert f"K8S_VERSION={json.loads(version)['gitVersion']}\n" in built


def test_pods_resolve_service_names_through_the_cluster_dns(node_cluster: LocalCluster) -> None:
    """The kubelet names CoreDNS to every pod, as any real cluster's does: Service names
    resolve (the API server's Service, by its short name through the search path)."""
    apply(node_cluster, busybox_pod("resolver", "exec sleep 3600"))
    running(node_cluster, "resolver")
    resolv = node_cluster.kubectl("exec", "resolver", "--", "cat", "/etc/resolv.conf").stdout
    assert f"nameserver {node_cluster.node.network.host_ip}" in resolv
    assert "search default.svc.cluster.local svc.cluster.local cluster.local" in resolv
    api = get(node_cluster, "service", "kubernetes")["spec"]["clusterIP"]
    fqdn = "kubernetes.default.svc.cluster.local"
    answer = node_cluster.kubectl("exec", "resolver", "--", "nslookup", fqdn, check=False)
    assert api in answer.stdout.split("Name:", 1)[-1], (answer.stdout, answer.stderr)
    # The short name, through the search path (libc's resolver, as a client uses it).
    token = "$(cat /var/run/secrets/kubernetes.io/serviceaccount/token)"
    fetch = (
        f'wget -qO- --no-check-certificate --header "Authorization: Bearer {token}"'
        " https://kubernetes.default/version"
    )
    version = node_cluster.kubectl("exec", "resolver", "--", "sh", "-c", fetch, check=False)
    assert "gitVersion" in version.stdout, (version.stdout, version.stderr)


def test_killed_container_restarts_in_place(node_cluster: LocalCluster) -> None:
    apply(node_cluster, http_pod("phoenix"))
    before = running(node_cluster, "phoenix")
    (container,) = [c for c in node_cluster.node.containers() if c["pod"] == "phoenix"]
    os.kill(int(container["pid"]), signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        pod = get(node_cluster, "pod", "phoenix")
        (status,) = pod["status"]["containerStatuses"]
        return pod if status["restartCount"] == 1 and status["ready"] else None

    after = eventually(restarted, timeout=Timeouts.POD_READY, message="restart in place")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["status"]["podIP"] == before["status"]["podIP"]


def ready_endpoints(cluster: LocalCluster, service: str) -> list[str]:
    slices = get(cluster, "endpointslices", "-l", f"kubernetes.io/service-name={service}")
    return [
        address
        for item in slices["items"]
        for endpoint in item.get("endpoints") or []
        if endpoint.get("conditions", {}).get("ready")
        for address in endpoint["addresses"]
    ]


def test_readiness_gate_holds_a_pod_out_of_endpoints(node_cluster: LocalCluster) -> None:
    apply(node_cluster, http_pod("gated", readinessGates=[{"conditionType": GATE}]))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gated"},
        "spec": {"selector": {"app": "gated"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    apply(node_cluster, service)
    pod = running(node_cluster, "gated")

    def probed() -> bool:
        conditions = get(node_cluster, "pod", "gated")["status"]["conditions"]
        return any(c["type"] == "ContainersReady" and c["status"] == "True" for c in conditions)

    eventually(probed, timeout=Timeouts.POD_READY, message="container probed ready")
    assert ready_endpoints(node_cluster, "gated") == []
    condition = {"type": GATE, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    patch = {"status": {"conditions": [condition]}}
    node_cluster.kubectl(
        "patch", "pod", "gated", "--subresource=status", "--type=strategic", "-p", json.dumps(patch)
    )
    ip = pod["status"]["podIP"]
    eventually(
        lambda: ready_endpoints(node_cluster, "gated") == [ip],
        timeout=Timeouts.API,
        message="released pod in the EndpointSlice",
    )
    cluster_ip = get(node_cluster, "service", "gated")["spec"]["clusterIP"]
    through_service = node_cluster.kubectl(
        "exec", "gated", "--", "wget", "-qO-", f"http://{cluster_ip}/name"
    ).stdout
    assert through_service.strip() == "gated"


def test_dev_shm_is_per_pod_and_sized_by_a_memory_volume(node_cluster: LocalCluster) -> None:
    volume = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}}
    mount = {"volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}
    script = "echo mine > /dev/shm/owner && exec sleep 3600"
    apply(node_cluster, busybox_pod("shm-a", script, container=mount, volumes=[volume]))
    apply(node_cluster, busybox_pod("shm-b", "exec sleep 3600"))
    running(node_cluster, "shm-a")
    running(node_cluster, "shm-b")

    def size_kib(pod: str) -> int:
        df = node_cluster.kubectl("exec", pod, "--", "df", "-k", "/dev/shm").stdout
        return int(df.splitlines()[-1].split()[1])

    assert size_kib("shm-a") == 256 * 1024
    assert size_kib("shm-b") == 64 * 1024  # the runtime's default, too small for slots
    seen = node_cluster.kubectl("exec", "shm-b", "--", "ls", "/dev/shm").stdout
    assert "owner" not in seen


def machine_state() -> dict[str, object]:
    """What a node may change on this machine, outside its own state directory."""

    def run(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    return {
        "links": sorted(line.split()[0] for line in run("ip", "-br", "link").splitlines()),
        "routes": run("ip", "route"),
        "netns": sorted(os.listdir("/run/netns")) if Path("/run/netns").exists() else [],
        "nftables": run("nft", "list", "ruleset"),
        "iptables": [
            line for line in run("iptables-save").splitlines() if not line.startswith("#")
        ],
        "sysctls": host.read_sysctls(),
        "cgroups": sorted(
            str(path)
            for hierarchy in host.cgroup_hierarchies()
            for path in hierarchy.iterdir()
            if path.is_dir()
        ),
        "log_links": sorted(os.listdir(host.CONTAINER_LOG_LINKS))
        if host.CONTAINER_LOG_LINKS.exists()
        else [],
        "mounts": sorted(
            line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
        ),
    }


def test_down_leaves_the_machine_as_it_was_beside_another_cluster(
    node_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A second cluster comes and goes while the first keeps running."""
    before = machine_state()
    second = LocalCluster(  # a short path: the node's Unix sockets live under it
        state_dir=tmp_path_factory.mktemp("c2"), bin_dir=node_cluster.bin_dir, nodes=0,
        real_node=True,
    )  # fmt: skip
    try:
        second.up()
        assert second.node.network != node_cluster.node.network
        second.node.import_archive(busybox_archive(CACHE_DIR))
        apply(second, http_pod("tenant"))
        running(second, "tenant")
        during = machine_state()
        assert during != before
    finally:
        second.down()
    after = machine_state()
    for key, value in before.items():
        if key == "log_links":  # the session's other node removes its own as pods go
            continue
        assert after[key] == value, key
    links_after, links_before = after["log_links"], before["log_links"]
    assert isinstance(links_after, list)
    assert isinstance(links_before, list)
    assert set(links_after) <= set(links_before)
    assert not host.log_links_into(second.state_dir)
    assert not host.processes_with(str(second.state_dir))
    # The first cluster's pods were never touched.
    assert get(node_cluster, "pod", "reach")["status"]["phase"] == "Running"
