"""Trainer pods of several ranks: what the webhook injects, and the members the reconcile plans."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest

from tests.unit.controller.builders import pod, sink_view, sync
from tests.unit.controller.test_injection import TEMPLATE, agent_of, env_of
from weightsync.api import agent_env
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names
from weightsync.controller.admission.injection import injection_patch
from weightsync.controller.membership.owners import WorkloadRef, select_target
from weightsync.controller.membership.plan import desired_members
from weightsync.controller.membership.trainer_ranks import (
    ServedRanks,
    recorded_ranks,
    served_ranks,
    source_ranks,
)
from weightsync.controller.membership.workloads import (
    World,
    planned_sources,
    pods_to_recreate,
    sync_pods,
)


def trainer_pod(ordinal: int, gpus: bool = False) -> dict[str, Any]:
    """A trainer pod; `gpus`: its container's GPUs come from a ResourceClaim."""
    builder = (
        pod(f"trainer-{ordinal}")
        .owned_by("StatefulSet", "trainer", uid="sts-uid")
        .label(names.STATEFULSET_POD_INDEX_LABEL, str(ordinal))
    )
    if gpus:
        builder.set("spec.resourceClaims", [{"name": "gpus", "resourceClaimTemplateName": "g"}])
        builder.set("spec.containers", [{"name": "main", "image": "trainer:1", "resources": {
            "claims": [{"name": "gpus"}]}}])  # fmt: skip
    return builder.build()


FOUR = {"spec.trainer.ranksPerPod": 4}


@pytest.mark.parametrize(
    ("paths", "ordinal", "expected"),
    [
        ({}, 0, ServedRanks(1, (0,))),  # the default: rank 0 of one-rank pods
        ({}, 1, ServedRanks(1, ())),
        (FOUR, 0, ServedRanks(4, (0,))),
        ({"spec.trainer.sourceRanks": ["all"], **FOUR}, 1, ServedRanks(4, (0, 1, 2, 3))),
        ({"spec.trainer.sourceRanks": [5, 6, 9], **FOUR}, 1, ServedRanks(4, (1, 2))),
    ],
)  # fmt: skip
def test_served_ranks_follow_torchrun_numbering(
    paths: dict[str, Any], ordinal: int, expected: ServedRanks
) -> None:
    assert served_ranks(sync(**paths), ordinal) == expected


def test_a_pod_of_no_source_rank_gets_no_sidecar() -> None:
    syncs = [sync(**{"spec.trainer.sourceRanks": [4], **FOUR})]
    workload = WorkloadRef("StatefulSet", "trainer")
    assert select_target(workload, trainer_pod(0, gpus=True), syncs) is None
    target = select_target(workload, trainer_pod(1, gpus=True), syncs)
    assert target is not None
    assert target.served == ServedRanks(4, (0,))


def _inject(raw: dict[str, Any], **paths: Any) -> dict[str, Any]:
    spec = sync(**paths)
    target = select_target(WorkloadRef("StatefulSet", "trainer"), raw, [spec])
    assert target is not None
    ops = injection_patch(
        raw, sync=spec, role=Role.SOURCE, inference_index=None, namespace="ns",
        template=TEMPLATE, served=target.served,
    )  # fmt: skip
    patched: dict[str, Any] = jsonpatch.JsonPatch(ops).apply(raw)
    return patched


def test_a_pod_of_several_ranks_gets_one_sidecar_serving_each() -> None:
    paths = {"spec.trainer.sourceRanks": ["all"], "spec.trainer.ranksPerPod": 2}
    patched = _inject(trainer_pod(1, gpus=True), **paths)
    agent = agent_of(patched)
    env = env_of(agent)
    assert env[agent_env.LOCAL_RANKS] == "0,1"
    assert env[agent_env.SOCKET] == agent_env.SOCKET_TEMPLATE
    assert env[agent_env.DEVICE] == "cuda:0"  # the base: local rank i runs on cuda:i
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports == {
        "ws-control": 8470, "ws-metrics": 9470, "ws-control-1": 8471, "ws-metrics-1": 9471
    }  # fmt: skip
    assert agent["readinessProbe"]["tcpSocket"] == {"port": 8470}
    trainer = patched["spec"]["containers"][0]
    assert env_of(trainer)[agent_env.SOCKET] == agent_env.SOCKET_TEMPLATE
    annotations = patched["metadata"]["annotations"]
    assert annotations[names.RANKS_PER_POD_ANNOTATION] == "2"
    assert annotations[names.AGENT_RANKS_ANNOTATION] == "0,1"
    assert recorded_ranks(patched) == ServedRanks(2, (0, 1))


def test_a_pod_serving_one_of_its_ranks_listens_where_that_rank_does() -> None:
    patched = _inject(trainer_pod(0, gpus=True), **{"spec.trainer.sourceRanks": [3], **FOUR})
    agent = agent_of(patched)
    assert env_of(agent)[agent_env.LOCAL_RANKS] == "3"
    assert agent["readinessProbe"]["tcpSocket"] == {"port": 8473}
    assert {p["containerPort"] for p in agent["ports"]} == {8473, 9473}


def test_a_one_rank_pod_is_injected_as_before() -> None:
    patched = _inject(trainer_pod(0))
    env = env_of(agent_of(patched))
    assert agent_env.LOCAL_RANKS not in env
    assert env[agent_env.SOCKET] == agent_env.SOCKET_PATH
    assert recorded_ranks(patched) == ServedRanks(1, (0,))


def _world(*pods: dict[str, Any], replicas: int = 2) -> World:
    statefulset = {"metadata": {"uid": "sts-uid"}, "spec": {"replicas": replicas}}
    return World(trainer=statefulset, engines={}, controllers=[], pods=list(pods))


def _running(raw: dict[str, Any], ip: str) -> dict[str, Any]:
    raw["status"] = {
        "phase": "Running", "podIP": ip,
        "conditions": [{"type": "ContainersReady", "status": "True"}],
    }  # fmt: skip
    return raw


def test_each_served_rank_is_a_member_with_its_own_port_and_device() -> None:
    paths = {"spec.trainer.sourceRanks": ["all"], "spec.trainer.ranksPerPod": 2}
    pods = [
        _running(_inject(trainer_pod(i, gpus=True), **paths), f"10.0.0.{i + 1}") for i in (0, 1)
    ]
    for raw in pods:
        raw["metadata"]["annotations"][names.AGENT_DEVICE_ANNOTATION] = "cuda:0"
    spec = sync(**paths)
    views = sync_pods(spec, _world(*pods))
    assert [(v.name, v.pod_name, v.rank, v.agent_port, v.device) for v in views] == [
        ("trainer-0[0]", "trainer-0", 0, 8470, "cuda:0"),
        ("trainer-0[1]", "trainer-0", 1, 8471, "cuda:1"),
        ("trainer-1[0]", "trainer-1", 2, 8470, "cuda:0"),
        ("trainer-1[1]", "trainer-1", 3, 8471, "cuda:1"),
    ]
    assert planned_sources(spec, _world(*pods), views) == [0, 1, 2, 3]
    sinks = [sink_view("engine-a-1")]
    answering = {v.name for v in [*views, *sinks]}
    desired = desired_members(spec.spec, [*views, *sinks], answering, [], sources=[0, 1, 2, 3])
    assert [m.name for m in desired.members] == [
        "trainer-0[0]", "trainer-0[1]", "trainer-1[0]", "trainer-1[1]", "engine-a-1"
    ]  # fmt: skip
    # A rank whose agent does not answer holds the group back, named.
    answering.discard("trainer-1[1]")
    waiting = desired_members(spec.spec, [*views, *sinks], answering, [], sources=[0, 1, 2, 3])
    assert waiting.waiting_for == "the source agent of trainer rank 3"


def test_all_ranks_counts_every_pod_of_the_statefulset() -> None:
    spec = sync(**{"spec.trainer.sourceRanks": ["all"], "spec.trainer.ranksPerPod": 4})
    assert source_ranks(spec, replicas=3, per_pod=[]) == list(range(12))
    assert source_ranks(sync(**{"spec.trainer.sourceRanks": [7, 2]}), 3, [4]) == [2, 7]
    # Without a pod yet, the group waits for rank 0's pod whatever the count.
    alone = sync(**{"spec.trainer.sourceRanks": ["all"]})
    assert desired_members(alone.spec, [], set(), [], sources=[]).waiting_for


def test_an_uninjected_pod_of_several_ranks_is_recreated_once() -> None:
    raw = trainer_pod(0, gpus=True)
    raw["metadata"]["labels"][names.INJECT_LABEL] = names.INJECT_VALUE
    raw["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    spec = sync(**{"spec.trainer.sourceRanks": ["all"], "spec.trainer.ranksPerPod": 2})
    views = sync_pods(spec, _world(raw, replicas=1))
    assert len(views) == 2
    created = views[0].created
    assert created is not None
    from datetime import timedelta

    again = pods_to_recreate(views, created, timedelta(seconds=60))
    assert [v.pod_name for v in again] == ["trainer-0"]


def test_the_watch_keeps_what_the_ranks_of_a_pod_are_read_from() -> None:
    from weightsync.controller.cluster.cache import slim_pod

    paths = {"spec.trainer.sourceRanks": ["all"], "spec.trainer.ranksPerPod": 2}
    spec = sync(**paths)
    injected = _running(_inject(trainer_pod(0, gpus=True), **paths), "10.0.0.1")
    missed = trainer_pod(1, gpus=True)  # the webhook was away: ranks from the spec
    whole = sync_pods(spec, _world(injected, missed))
    assert len(whole) == 4
    assert sync_pods(spec, _world(slim_pod(injected), slim_pod(missed))) == whole
