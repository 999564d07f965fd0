"""The watch's copies: slim pods as `workloads` reads them, and when a watched
WeightSync is new enough for a pass."""

from __future__ import annotations

from typing import Any

from tests.unit.controller.builders import pod
from weightsync.api.v1alpha1 import Role
from weightsync.controller.cache import newest, pod_key, slim_pod
from weightsync.controller.workloads import pod_view


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
