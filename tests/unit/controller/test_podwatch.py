"""The pod watch's store: what passes read, and the changes a list or a watch event makes.
(The watch against the API server itself is in tests/cluster/test_podwatch.py.)"""

from __future__ import annotations

from typing import Any

from tests.unit.controller.builders import pod
from weightsync.controller.cluster import pod_actions
from weightsync.controller.cluster.cache import Indexes, slim_pod
from weightsync.controller.cluster.podwatch import ADDED, DELETED, MODIFIED, PodStore


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
