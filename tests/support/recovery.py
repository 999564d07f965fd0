"""Helpers for recovery tests: crash a container, read digests, watch Ready transitions."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from tests.support.kube import condition


def http_json(method: str, url: str, timeout: float = 60.0, token: str = "") -> Any:
    request = urllib.request.Request(url, method=method)  # noqa: S310 - test URLs
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 - test URLs
        return json.loads(reply.read())


def kill_container(pid_dir: Path, pod: dict[str, Any], container: str) -> None:
    """SIGKILL a pod runner process, as a crash would (its PID file names pod and container)."""
    uid = pod["metadata"]["uid"][:8]
    path = pid_dir / f"pod-{uid}-{container}.pid"
    if not path.exists():
        known = sorted(p.name for p in pid_dir.glob("pod-*.pid"))
        raise FileNotFoundError(f"{path.name} not among {known}")
    pid = int(path.read_text())
    os.kill(pid, signal.SIGKILL)


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
    `current()` (no polling: a poll can miss a short Ready)."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        selector: str,
        port: int,
        current: Callable[[], int | None],
    ) -> None:
        self.api, self.namespace, self.selector, self.port = api, namespace, selector, port
        self.current = current
        # (pod, engine version, current version) when first seen Ready; None: no answer
        self.seen: list[tuple[str, int | None, int | None]] = []
        self._ready: set[str] = set()
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
