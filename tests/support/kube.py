"""Small helpers for tests that talk to the API server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch


def watch_pods_until(
    api: client.ApiClient,
    namespace: str,
    predicate: Callable[[str, dict[str, Any]], bool],
    *,
    timeout: float,
    label_selector: str = "",
) -> dict[str, Any]:
    """Watch pods (no polling: a controller can replace a pod faster than a poll sees it)
    until `predicate(event_type, pod)` holds; return that pod. Existing pods count too."""
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    listing = core.list_namespaced_pod(namespace, label_selector=label_selector)
    for pod in listing.items:
        raw = api.sanitize_for_serialization(pod)
        if predicate("EXISTING", raw):
            return raw
    version = listing.metadata.resource_version
    while (left := deadline - time.monotonic()) > 0:
        stream = watch.Watch().stream(
            core.list_namespaced_pod,
            namespace,
            label_selector=label_selector,
            resource_version=version,
            timeout_seconds=max(1, int(left)),
            _preload_content=False,
        )
        for event in stream:
            raw = event["raw_object"]
            version = raw["metadata"].get("resourceVersion", version)
            if event["type"] != "ERROR" and predicate(event["type"], raw):
                return raw
    raise TimeoutError(f"no pod in {namespace} matched within {timeout:.0f}s")


def condition(obj: dict[str, Any], kind: str) -> str | None:
    """The status ('True'/'False'/'Unknown') of condition `kind`, or None if absent."""
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            return str(item.get("status"))
    return None


def deployment(
    name: str,
    *,
    replicas: int = 1,
    annotations: dict[str, str] | None = None,
    containers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A minimal Deployment manifest on the KWOK nodes (its pods are scheduled, never run);
    containers default to one that does nothing."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations or {}},
                "spec": {
                    "containers": containers or [{"name": "main", "image": "busybox:1.36"}],
                    "terminationGracePeriodSeconds": 1,
                    "nodeSelector": {"type": "kwok"},
                },
            },
        },
    }
