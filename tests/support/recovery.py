"""Helpers for recovery tests: crash a container, read digests, watch Ready transitions."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from kubernetes import client, watch

from tests.cluster.controlplane import LocalCluster
from tests.cluster.node.realnode import RealNode
from tests.support.kube import condition


def http_json(method: str, url: str, timeout: float = 60.0, token: str = "") -> Any:
    request = urllib.request.Request(url, method=method)  # noqa: S310 - test URLs
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 - test URLs
        return json.loads(reply.read())


def running_container(node: RealNode, pod: dict[str, Any], container: str) -> dict[str, Any]:
    """The node's one running instance of `container` of `pod` (pid, attempt, id...)."""
    name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
    running = [
        c
        for c in node.containers()
        if (c["namespace"], c["pod"], c["container"]) == (namespace, name, container)
        and c["state"] == "CONTAINER_RUNNING"
    ]
    if len(running) != 1:
        raise LookupError(f"{container} of {namespace}/{name}: {len(running)} running")
    return running[0]


def kill_container(node: RealNode, pod: dict[str, Any], container: str) -> int:
    """SIGKILL a container's process on the real node, as a crash would; the kubelet then
    restarts it in place (same pod, same IP). Returns the restart count it had."""
    found = running_container(node, pod, container)
    os.kill(int(str(found["pid"])), signal.SIGKILL)
    return int(str(found["attempt"]))


_PARTITION_TABLE = "weightsync_chaos"
_PARTITION_RULES = f"""table inet {_PARTITION_TABLE} {{
  chain input {{ type filter hook input priority -10; policy accept; iifname != "lo" drop; }}
  chain output {{ type filter hook output priority -10; policy accept; oifname != "lo" drop; }}
}}
"""


@contextmanager
def partitioned(node: RealNode, pod: dict[str, Any], container: str) -> Iterator[None]:
    """Cut `pod` off the network (every packet on its interfaces but loopback dropped, in
    its own network namespace) while the block runs: its peers, the kubelet's probes and
    the operator all lose it; its containers keep running and talk to each other."""
    netns = f"--net=/proc/{running_container(node, pod, container)['pid']}/ns/net"
    subprocess.run(["nsenter", netns, "nft", "-f", "-"], input=_PARTITION_RULES, text=True,
                   check=True, timeout=30)  # fmt: skip
    try:
        yield
    finally:
        subprocess.run(["nsenter", netns, "nft", "delete", "table", "inet", _PARTITION_TABLE],
                       check=False, timeout=30)  # fmt: skip


_CORRUPT_TABLE = "weightsync_chaos_corrupt"


@contextmanager
def corrupted(
    node: RealNode, pod: dict[str, Any], container: str, spare_ports: Iterable[int]
) -> Iterator[None]:
    """Corrupt the bulk data `pod` receives while the block runs, as a bad link or NIC
    would: nftables rewrites four payload bytes, 1 KiB into every TCP segment of more
    than 2 KiB that arrives (its own network namespace; the TCP checksum is fixed up, so
    the bytes are delivered as if the wire had carried them). `spare_ports`: TCP ports
    left alone on either side (control APIs), so what is hit is broadcast buckets and
    P2P pulls, past their framing headers."""
    ports = ", ".join(str(port) for port in sorted(set(spare_ports)))
    rules = f"""table inet {_CORRUPT_TABLE} {{
  chain input {{
    type filter hook input priority -10; policy accept;
    iifname != "lo" tcp sport != {{ {ports} }} tcp dport != {{ {ports} }} \\
      meta length > 2048 @ih,8192,32 set 0xdeadbeef
  }}
}}
"""
    netns = f"--net=/proc/{running_container(node, pod, container)['pid']}/ns/net"
    subprocess.run(["nsenter", netns, "nft", "-f", "-"], input=rules, text=True, check=True,
                   timeout=30)  # fmt: skip
    try:
        yield
    finally:
        subprocess.run(["nsenter", netns, "nft", "delete", "table", "inet", _CORRUPT_TABLE],
                       check=False, timeout=30)  # fmt: skip


def replace_pod(cluster: LocalCluster, pod: dict[str, Any]) -> None:
    """Delete `pod` at once (grace 0), as a node failure or an eviction would: its
    controller creates a new pod, with a new name and IP, that starts from nothing."""
    cluster.kubectl(
        "delete", "pod", pod["metadata"]["name"], "-n", pod["metadata"]["namespace"],
        "--grace-period=0", "--force", "--wait=false",
    )  # fmt: skip


def pod_logs(cluster: LocalCluster, namespace: str) -> dict[str, str]:
    """Every container log the real node kept for `namespace`'s pods (restarts included)."""
    return {
        str(path.relative_to(cluster.node.pod_logs)): path.read_text(errors="replace")
        for path in cluster.node.pod_logs.glob(f"{namespace}_*/*/*.log")
    }


def engine_digest(pod: dict[str, Any], port: int) -> dict[str, Any]:
    result: dict[str, Any] = http_json(
        "GET", f"http://{pod['status']['podIP']}:{port}/v1/weights/digest"
    )
    return result


def agent_token(api: client.ApiClient, namespace: str, secret: str) -> str:
    """The agents' control API token, from the Secret the operator made for the sync."""
    data = client.CoreV1Api(api).read_namespaced_secret(secret, namespace).data
    return base64.b64decode(data["token"]).decode()


class ReadyWatch:
    """Watches pods in the background and records every pod seen Ready=True, with the
    engine's version read at that moment and the version it should serve then, from
    `current()` (no polling: a poll can miss a short Ready). `container`: the same for
    that container's own readiness (`container_seen`, answered reads only), which the
    kubelet can turn into the pod's Ready on a gate it cached."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        selector: str,
        port: int,
        current: Callable[[], int | None],
        *,
        container: str | None = None,
    ) -> None:
        self.api, self.namespace, self.selector, self.port = api, namespace, selector, port
        self.current, self.container = current, container
        # (pod, engine version, current version) when first seen Ready; None: no answer
        self.seen: list[tuple[str, int | None, int | None]] = []
        self.container_seen: list[tuple[str, int | None, int | None]] = []
        self._ready: set[str] = set()
        self._container_ready: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ready-watch")

    def __enter__(self) -> ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        core = client.CoreV1Api(self.api)
        while not self._stop.is_set():
            stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                core.list_namespaced_pod,
                self.namespace,
                label_selector=self.selector,
                timeout_seconds=2,
                _preload_content=False,
            )
            for event in stream:
                self._see(event["raw_object"])
                if self._stop.is_set():
                    return

    def _see(self, pod: dict[str, Any]) -> None:
        name = pod.get("metadata", {}).get("name", "")
        if self.container is not None:
            self._see_container(name, pod)
        if condition(pod, "Ready") != "True":
            self._ready.discard(name)
            return
        if name in self._ready:
            return
        self._ready.add(name)
        try:
            version = engine_digest(pod, self.port)["version"]
        except OSError:
            version = None  # the pod is going away (killed just now)
        try:
            current = self.current()
        except OSError:
            current = None
        self.seen.append((name, version, current))

    def _see_container(self, name: str, pod: dict[str, Any]) -> None:
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        ready = any(c["name"] == self.container and c.get("ready") for c in statuses)
        if not ready:
            self._container_ready.discard(name)
            return
        if name in self._container_ready:
            return
        self._container_ready.add(name)
        try:
            version = engine_digest(pod, self.port)["version"]
            current = self.current()
        except OSError:
            return  # going away, or the trainer busy: nothing to compare
        self.container_seen.append((name, version, current))
