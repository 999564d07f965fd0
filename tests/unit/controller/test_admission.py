"""The pod webhook's handler body: it patches through kopf's Patch and never denies a pod."""

from __future__ import annotations

from typing import Any

import jsonpatch
import kopf
import pytest
from kubernetes import client

from tests.unit.api.builders import weightsync
from tests.unit.controller.builders import pod
from weightsync.controller.admission.review import apply_patch, front_errors, inject, set_patch
from weightsync.controller.admission.sidecar import AgentTemplate
from weightsync.controller.cluster.cache import REPLICASET_OWNERS_INDEX, Indexes, replicaset_owner
from weightsync.controller.cluster.kube import Kube

TEMPLATE = AgentTemplate(image="agent:1")


def unreachable_api() -> Kube:
    configuration = client.Configuration(host="https://127.0.0.1:1")
    configuration.retries = 0
    return Kube(client.ApiClient(configuration))


def test_an_api_failure_admits_the_pod_unchanged(caplog: pytest.LogCaptureFixture) -> None:
    body = pod("").owned_by("ReplicaSet", "engine-a-7d9").build()
    patch = kopf.Patch(body=kopf.Body(body))
    inject(unreachable_api(), TEMPLATE, body, patch)  # must not raise
    assert "admitting it unchanged" in caplog.text  # the ReplicaSet lookup did fail
    assert not patch
    assert patch.as_json_patch() == []


def test_the_replicaset_owner_comes_from_the_watch_and_a_miss_from_the_api() -> None:
    replicaset = pod("engine-a-7d9").owned_by("Deployment", "engine-a").build()
    indexes = Indexes()
    indexes.bind(
        {REPLICASET_OWNERS_INDEX: {("ns", "engine-a-7d9"): [replicaset_owner(replicaset)]}}
    )
    kube = unreachable_api()
    assert kube.replicaset_owner("ns", "engine-a-7d9", indexes) == "engine-a"  # no request
    with pytest.raises(Exception, match=r"127\.0\.0\.1"):  # newer than the watch: one GET
        kube.replicaset_owner("ns", "engine-a-8e1", indexes)
    orphan = pod("lonely-1").build()
    assert replicaset_owner(orphan) == {"deployment": None}


def test_pods_without_a_controller_are_left_alone_without_asking_the_api(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = pod("naked").build()
    patch = kopf.Patch(body=kopf.Body(body))
    inject(unreachable_api(), TEMPLATE, body, patch)
    assert not patch
    assert "admitting it unchanged" not in caplog.text


def test_kopf_turns_the_applied_patch_back_into_the_same_change() -> None:
    body = pod("p").build()
    ops: list[dict[str, Any]] = [
        {"op": "add", "path": "/spec/initContainers", "value": [{"name": "weightsync-agent"}]},
        {"op": "add", "path": "/metadata/labels/weightsync.io~1role", "value": "sink"},
    ]
    patch = kopf.Patch(body=kopf.Body(body), fns=[apply_patch(ops)])
    rederived = patch.as_json_patch()
    assert {
        "op": "add",
        "path": "/spec/initContainers",
        "value": [{"name": "weightsync-agent"}],
    } in rederived
    assert {
        "op": "add",
        "path": "/metadata/labels/weightsync.io~1role",
        "value": "sink",
    } in rederived
    assert len(rederived) == 2


def test_the_patch_sent_is_the_ops_and_does_what_kopfs_derived_one_does() -> None:
    """kopf's own derivation (apply, then diff the pod) is skipped: the ops are sent as
    they are, and they change the pod as the derived patch would."""
    body = pod("p").owned_by("ReplicaSet", "rs").build()
    ops: list[dict[str, Any]] = [
        {"op": "add", "path": "/spec/initContainers", "value": [{"name": "weightsync-agent"}]},
        {"op": "add", "path": "/metadata/labels/weightsync.io~1role", "value": "sink"},
    ]
    patch = kopf.Patch(body=kopf.Body(body))
    set_patch(patch, ops)
    assert patch
    assert patch.as_json_patch() == ops
    derived = kopf.Patch.as_json_patch(patch)  # the class's: kopf's own derivation
    assert jsonpatch.apply_patch(body, ops) == jsonpatch.apply_patch(body, derived)


@pytest.mark.parametrize(
    ("port", "errors"),
    [
        (8001, []),
        (8470, ["spec.inference[1].front.port: 8470 is the agent's control port in the"
                " injected sidecar; choose another port"]),
        (9470, ["spec.inference[1].front.port: 9470 is the agent's metrics port in the"
                " injected sidecar; choose another port"]),
    ],
)  # fmt: skip
def test_a_front_on_one_of_the_agents_own_ports_is_refused(port: int, errors: list[str]) -> None:
    body = weightsync().inference("engine-b", front={"port": port}).build()
    assert front_errors(body, TEMPLATE) == errors
    assert front_errors(body, AgentTemplate(image="a", http_port=7000, metrics_port=0)) == []
