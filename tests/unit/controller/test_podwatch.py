"""The pod watch's store: what passes read, and the changes a list or a watch event makes;
a watch ended by a 410. (The watch against the API server itself is in
tests/cluster/test_podwatch.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web
from kubernetes import client

from tests.integration.stack import free_port
from tests.unit.controller.builders import pod
from weightsync.controller.cluster import pod_actions
from weightsync.controller.cluster.cache import Indexes, slim_pod
from weightsync.controller.cluster.podwatch import ADDED, DELETED, MODIFIED, PodStore, PodWatch


def engine(name: str, version: str, *, namespace: str = "ns", rs: str = "engine-a-abc") -> Any:
    raw = pod(name).owned_by("ReplicaSet", rs).running().injected(gate=True).build()
    raw["metadata"].update(resourceVersion=version, namespace=namespace)
    return raw


def names_of(pods: Any) -> list[str]:
    return sorted(p["metadata"]["name"] for p in pods)


def test_nothing_is_answered_before_the_first_list_so_passes_list_for_themselves() -> None:
    store = PodStore()
    store.put(engine("e-1", "1"))  # a watch event cannot come before a list; still
    assert store.pods_of("ns", "uid-engine-a-abc") is None
    assert Indexes(store).pods_of("ns", "uid-engine-a-abc") is None
    assert Indexes().pods_of("ns", "uid-engine-a-abc") is None  # no watch at all
    store.relist("other", [])
    assert store.pods_of("ns", "uid-engine-a-abc") is None  # another namespace listed
    store.relist("ns", [engine("e-1", "1")])
    assert names_of(store.pods_of("ns", "uid-engine-a-abc") or []) == ["e-1"]
    assert store.pods_of("ns", "uid-nobody") == []


def test_pods_are_kept_slim_by_owner() -> None:
    store = PodStore()
    changes = store.relist(None, [engine("e-1", "1"), engine("e-2", "2", rs="engine-a-new")])
    assert [(c, p["metadata"]["name"]) for c, p in changes] == [(ADDED, "e-1"), (ADDED, "e-2")]
    assert store.pods_of("ns", "uid-engine-a-abc") == [slim_pod(engine("e-1", "1"))]
    assert names_of(store.pods_of("ns", "uid-engine-a-new") or []) == ["e-2"]
    assert names_of(store.pods_of("ns2", "uid-engine-a-abc") or []) == []


def test_a_version_already_kept_is_no_change() -> None:
    store = PodStore()
    store.relist(None, [engine("e-1", "1")])
    assert store.put(engine("e-1", "1")) is None
    changed = engine("e-1", "5")
    changed["status"]["podIP"] = "10.0.9.9"
    assert store.put(changed) == MODIFIED
    [kept] = store.pods_of("ns", "uid-engine-a-abc") or []
    assert kept["status"]["podIP"] == "10.0.9.9"


def test_a_deletion_forgets_the_pod_once() -> None:
    store = PodStore()
    store.relist(None, [engine("e-1", "1"), engine("e-2", "2")])
    assert store.drop("uid-e-1") is not None
    assert store.drop("uid-e-1") is None
    assert names_of(store.pods_of("ns", "uid-engine-a-abc") or []) == ["e-2"]
    store.drop("uid-e-2")
    assert store.pods_of("ns", "uid-engine-a-abc") == []


def test_a_list_again_reports_what_changed_in_between_deletions_included() -> None:
    store = PodStore()
    store.relist("ns", [engine("e-1", "1"), engine("e-2", "2")])
    store.relist("ns2", [engine("x-1", "3", namespace="ns2")])
    # Between the watch's end and the new list: e-1 changed, e-2 went, e-3 came.
    changes = store.relist("ns", [engine("e-1", "7"), engine("e-3", "8")])
    assert sorted((c, p["metadata"]["name"]) for c, p in changes) == [
        (ADDED, "e-3"), (DELETED, "e-2"), (MODIFIED, "e-1"),
    ]  # fmt: skip
    assert names_of(store.pods_of("ns", "uid-engine-a-abc") or []) == ["e-1", "e-3"]
    # Another namespace's pods are not that list's to delete.
    assert names_of(store.pods_of("ns2", "uid-engine-a-abc") or []) == ["x-1"]
    assert store.relist("ns", [engine("e-1", "7"), engine("e-3", "8")]) == []


def test_a_gate_closes_at_once_only_for_a_pod_restarting_behind_an_open_gate() -> None:
    def engine_pod(gate: str, containers_ready: bool, deleting: bool = False) -> Any:
        raw = pod("e").running(ready=containers_ready).injected(gate=True)
        raw = raw.gate(gate, "ServesCurrentVersion").build()
        if deleting:
            raw["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return raw

    assert pod_actions.restarting_behind_open_gate(engine_pod("True", containers_ready=False))
    assert not pod_actions.restarting_behind_open_gate(engine_pod("True", containers_ready=True))
    assert not pod_actions.restarting_behind_open_gate(engine_pod("False", containers_ready=False))
    assert not pod_actions.restarting_behind_open_gate(
        engine_pod("True", containers_ready=False, deleting=True)
    )


def test_a_watch_from_a_version_the_server_no_longer_keeps_lists_again() -> None:
    """The 410 path over HTTP, against a stand-in for the API server (named as such: the
    real one's watch cache serves any version since its start, so the cluster test cannot
    be sure to get a 410; tests/cluster/test_podwatch.py)."""
    requests: list[str] = []

    async def pods(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "true":
            requests.append("list")
            body = {"metadata": {"resourceVersion": "10"}, "items": [engine("e-1", "9")]}
            return web.json_response(body)
        requests.append(f"watch from {request.query['resourceVersion']}")
        gone = {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}
        return web.Response(text=json.dumps(gone) + "\n")

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ns/pods", pods)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))
        changes: list[str] = []
        watch = PodWatch(api, "a=b", ["ns"], PodStore(), lambda c, _ns, _p: changes.append(c))
        task = asyncio.get_running_loop().create_task(watch.run())
        try:
            deadline = time.monotonic() + 10
            while requests.count("list") < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await runner.cleanup()
        assert requests[:3] == ["list", "watch from 10", "list"]
        assert changes == [ADDED]  # the list again changed nothing
        assert names_of(watch.store.pods_of("ns", "uid-engine-a-abc") or []) == ["e-1"]

    asyncio.run(run())
