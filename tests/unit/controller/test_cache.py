"""The watch's copies: slim pods as `workloads` reads them (their views kept by version),
when a watched WeightSync is new enough for a pass (its status parsed once a version),
and a pass's observation from them alone."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from tests.unit.api.builders import weightsync
from tests.unit.controller.builders import pod
from weightsync.api import parse_weightsync
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names
from weightsync.controller.cluster.cache import Indexes, newest, pod_key, slim_pod
from weightsync.controller.cluster.kube import Kube, NotCachedError
from weightsync.controller.cluster.podwatch import PodStore
from weightsync.controller.membership.owners import WorkloadRef
from weightsync.controller.membership.workloads import pod_view
from weightsync.controller.passes.memory import Memory
from weightsync.controller.passes.observe import cached_status, without_status

TRAINER, ENGINE = WorkloadRef("StatefulSet", "trainer"), WorkloadRef("Deployment", "engine")


def test_a_slim_pod_reads_as_the_whole_pod() -> None:
    raw = (
        pod("e-1").owned_by("ReplicaSet", "engine-a-abc").running("10.0.1.1")
        .injected(gate=True).gate("True", "ServesCurrentVersion")
        .set("spec.volumes", [{"name": "big"}]).build()
    )  # fmt: skip
    whole = pod_view(raw, Role.SINK, "engine-a", 0, None)
    assert pod_view(slim_pod(raw), Role.SINK, "engine-a", 0, None) == whole
    assert pod_key("ns", raw) == ("ns", "uid-engine-a-abc")
    assert "volumes" not in slim_pod(raw)["spec"]


def sync_at(version: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "s", "resourceVersion": version}, "status": status}


def test_the_watched_weightsync_will_do_only_when_it_is_the_newest_known() -> None:
    assert newest(None, "5", None) is None  # nothing watched: ask
    assert newest(sync_at("5"), None, None) is None  # never seen: ask once
    assert newest(sync_at("5"), "5", None) == sync_at("5")
    reply = sync_at("7", members=3)
    # The status write was made on 5 and returned 7: until the watch brings 7, the
    # reply is the newest; then the watch is.
    assert newest(sync_at("5"), "5", ("5", reply)) is reply
    assert newest(sync_at("7"), "7", ("5", reply)) == sync_at("7")
    assert newest(sync_at("9"), "7", ("5", reply)) is None  # a change nobody has seen


def test_observe_from_the_caches_alone_calls_no_api() -> None:
    """What a pass observes on the event loop: every object from the watches, or
    `NotCachedError` (the pass then lists in a thread); never a blocking API call."""
    # A host nothing listens on: a call would fail, not hang, and fail the test.
    kube = Kube(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")))
    template = {"metadata": {"labels": {names.INJECT_LABEL: names.INJECT_VALUE}}}
    deployment = {"metadata": {"name": "engine", "uid": "d-1"}}
    replicaset = {
        "metadata": {"name": "engine-abc", "uid": "uid-engine-abc"},
        "spec": {"replicas": 1, "template": template},
    }
    store = PodStore()
    indexes = Indexes(store)
    with pytest.raises(NotCachedError):  # nothing bound yet
        kube.observe("ns", TRAINER, [ENGINE], indexes, cached_only=True)
    indexes.bind({
        "statefulsets_by_name": {},
        "deployments_by_name": {("ns", "engine"): [deployment]},
        "replicasets_by_owner": {("ns", "d-1"): [replicaset]},
    })  # fmt: skip
    with pytest.raises(NotCachedError, match="pods of ns/engine-abc"):  # no pod list yet
        kube.observe("ns", TRAINER, [ENGINE], indexes, cached_only=True)
    engine = pod("engine-abc-1").owned_by("ReplicaSet", "engine-abc").running("10.0.1.1").build()
    engine["metadata"]["namespace"] = "ns"
    store.relist("ns", [engine])
    world = kube.observe("ns", TRAINER, [ENGINE], indexes, cached_only=True)
    assert world.trainer is None
    assert world.engines == {"engine": deployment}
    assert [p["metadata"]["name"] for p in world.pods] == ["engine-abc-1"]


def test_a_pass_parses_the_weightsync_without_its_status_or_field_managers() -> None:
    raw = weightsync("s").namespace("ns").build()
    managed = [{"manager": "weightsync-operator", "fieldsV1": {"f:status": {}}}]
    stored = {**raw, "metadata": {**raw["metadata"], "managedFields": managed},
              "status": {"members": [{"rank": 0}]}}  # fmt: skip
    parsed = without_status(stored)
    assert parsed == raw
    assert parse_weightsync(parsed).spec == parse_weightsync(raw).spec
    assert stored["metadata"]["managedFields"] == managed  # the watch's copy is left alone


def test_a_pods_view_is_kept_by_its_version() -> None:
    raw = pod("e-1").owned_by("ReplicaSet", "engine-a-abc").running("10.0.1.1").build()
    stored = slim_pod({**raw, "metadata": {**raw["metadata"], "resourceVersion": "7"}})
    first = pod_view(stored, Role.SINK, "engine-a", 0, None)
    assert pod_view(stored, Role.SINK, "engine-a", 0, None) is first
    assert pod_view(stored, Role.SINK, "engine-b", 1, None).workload == "engine-b"
    moved = {**stored, "status": {**stored["status"], "podIP": "10.0.1.2"}}
    moved["metadata"] = {**stored["metadata"], "resourceVersion": "8"}
    assert pod_view(moved, Role.SINK, "engine-a", 0, None).ip == "10.0.1.2"
    unversioned = {**moved, "metadata": {**moved["metadata"], "resourceVersion": None}}
    assert pod_view(unversioned, Role.SINK, "engine-a", 0, None) is not pod_view(
        unversioned, Role.SINK, "engine-a", 0, None
    )


def test_a_pass_parses_the_stored_status_once_per_version() -> None:
    memory = Memory()
    raw = {"metadata": {"name": "s", "resourceVersion": "5"}, "status": {"currentVersion": 3}}
    old = cached_status(raw, memory)
    assert old.current_version == 3
    assert cached_status(raw, memory) is old
    newer = {"metadata": {"name": "s", "resourceVersion": "6"}, "status": {"currentVersion": 4}}
    assert cached_status(newer, memory).current_version == 4
