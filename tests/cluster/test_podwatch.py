"""The operator's pod watch against the API server: list, watch, and a list again after
an absence. Pods on KWOK nodes. A version the server no longer has (410) is a unit test
(`tests/unit/controller/test_podwatch.py`): this API server's watch cache serves a watch
from any version since its start, even after etcd compacted it (seen: resourceVersion 1
on a young cluster streamed bookmarks and the test hung), so no request here can be sure
to get one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.cluster.controlplane import LocalCluster
from tests.support.eventually import Timeouts
from tests.support.kube import deployment
from weightsync.controller.cluster.podwatch import (
    ADDED,
    DELETED,
    MODIFIED,
    PodStore,
    PodWatch,
)

pytestmark = pytest.mark.cluster

LABEL = "podwatch-test"  # not the inject label: no webhook of another test's operator


async def until(check: Callable[[], Any], what: str, within: float = Timeouts.POD_READY) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if found := check():
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {what} after {within} s")


def test_the_pod_watch_keeps_the_pods_of_each_owner(
    cluster: LocalCluster, namespace: str, k8s: client.ApiClient
) -> None:
    manifest = deployment("watched", replicas=2)
    manifest["spec"]["template"]["metadata"]["labels"][LABEL] = "yes"
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
    unwatched = deployment("unwatched", replicas=1)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(unwatched))
    apps, core = client.AppsV1Api(k8s), client.CoreV1Api(k8s)
    store = PodStore()
    changes: list[tuple[str, str, str]] = []

    def record(change: str, ns: str, pod: Any) -> None:
        changes.append((change, ns, pod["metadata"]["name"]))

    def kubectl(*args: str) -> Any:
        return asyncio.to_thread(cluster.kubectl, *args)

    async def body() -> None:
        def replicaset() -> str | None:
            found = apps.list_namespaced_replica_set(namespace, label_selector="app=watched")
            return found.items[0].metadata.uid if found.items else None

        owner = await until(replicaset, "ReplicaSet", Timeouts.API)

        def running(count: int) -> Callable[[], list[Any] | None]:
            def check() -> list[Any] | None:
                pods = store.pods_of(namespace, owner) or []
                up = [p for p in pods if p["status"].get("phase") == "Running"]
                return up if len(pods) == count == len(up) else None

            return check

        watch = PodWatch(k8s, f"{LABEL}=yes", [namespace], store, record)
        task = asyncio.get_running_loop().create_task(watch.run())
        try:
            pods = await until(running(2), "2 Running pods")
            assert all(c[1] == namespace for c in changes)
            assert not [c for c in changes if c[2].startswith("unwatched")]  # the selector
            # A scale-up and a deletion come in as watch events.
            await kubectl("scale", "deployment", "watched", "-n", namespace, "--replicas=3")
            await until(running(3), "3 Running pods")
            victim = pods[0]["metadata"]["name"]
            await kubectl("delete", "pod", "-n", namespace, victim, "--wait=false")
            await until(lambda: (DELETED, namespace, victim) in changes, "deletion")
            await until(running(3), "the replacement Running")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        # Changes while nobody watched: a new watch on the same store lists again and
        # reports them as events, the deletion included.
        kept = {p["metadata"]["name"] for p in store.pods_of(namespace, owner) or []}
        await kubectl("scale", "deployment", "watched", "-n", namespace, "--replicas=1")

        def two_gone() -> bool:
            left = core.list_namespaced_pod(namespace, label_selector=f"{LABEL}=yes").items
            return len(left) == 1

        await until(two_gone, "two pods gone", Timeouts.POD_REPLACED)
        changes.clear()
        task = asyncio.get_running_loop().create_task(watch.run())
        try:
            await until(running(1), "1 Running pod")
            deleted = {name for change, _, name in changes if change == DELETED}
            assert len(deleted) == len(kept) - 1, (changes, kept)
            assert deleted <= kept, (changes, kept)
            assert {c for c, _, _ in changes} <= {ADDED, MODIFIED, DELETED}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(body())
