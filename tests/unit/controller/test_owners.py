"""JobSet and Indexed Job trainers, LeaderWorkerSet engines: how their pods are traced to
a WeightSync and numbered (labels and owner chains as JobSet v0.10.1 and LWS v0.7.0 set
them)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.controller.builders import pod
from tests.unit.controller.builders import sync as parsed
from tests.unit.controller.test_workloads import Lookups
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names
from weightsync.controller.admission.review import workload_of
from weightsync.controller.membership.owners import (
    WorkloadRef,
    claim_conflicts,
    select_target,
    trainer_ordinal,
    trainer_pods,
)
from weightsync.controller.membership.workloads import World, planned_sources, sync_pods
from weightsync.controller.status.problems import unmet

LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER = "leaderworkerset.sigs.k8s.io/worker-index"


def obj(kind: str, name: str, uid: str, owner: tuple[str, str, str] | None = None,
        **spec: Any) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "uid": uid}
    if owner:
        meta["ownerReferences"] = [
            {"kind": owner[0], "name": owner[1], "uid": owner[2], "controller": True}
        ]
    return {"kind": kind, "metadata": meta, "spec": spec}


def jobset_sync(**paths: Any) -> Any:
    return parsed(
        spec__trainer__statefulSetRef=None,
        spec__trainer__jobSetRef={"name": "train"},
        spec__inference__0__deploymentRef=None,
        spec__inference__0__leaderWorkerSetRef={"name": "vllm"},
        **paths,
    )


def jobset_pod(job_index: int, completion: int) -> dict[str, Any]:
    return (
        pod(f"train-workers-{job_index}-{completion}-x")
        .owned_by("Job", f"train-workers-{job_index}", f"uid-job-{job_index}")
        .label(names.JOBSET_GLOBAL_INDEX_LABEL, str(job_index))
        .label(names.JOB_COMPLETION_INDEX_LABEL, str(completion))
        .running()
        .build()
    )


def leader(group: int) -> dict[str, Any]:
    return (
        pod(f"vllm-{group}")
        .owned_by("StatefulSet", "vllm", "uid-leaders")
        .label(LWS_NAME, "vllm")
        .label(LWS_GROUP, str(group))
        .label(LWS_WORKER, "0")
        .running()
        .build()
    )


def worker(group: int, index: int) -> dict[str, Any]:
    # A worker StatefulSet is controlled by its group's leader pod (LWS pod_controller).
    return (
        pod(f"vllm-{group}-{index}")
        .owned_by("StatefulSet", f"vllm-{group}", f"uid-workers-{group}")
        .label(LWS_NAME, "vllm")
        .label(LWS_GROUP, str(group))
        .label(LWS_WORKER, str(index))
        .running()
        .build()
    )


JOBSET = {
    "kind": "JobSet",
    "metadata": {"name": "train", "uid": "uid-jobset"},
    "spec": {"replicatedJobs": [{"replicas": 2, "template": {"spec": {"completions": 2}}}]},
}
JOBS = [
    obj("Job", f"train-workers-{i}", f"uid-job-{i}", ("JobSet", "train", "uid-jobset"),
        completions=2)
    for i in range(2)
]  # fmt: skip
LWS = obj("LeaderWorkerSet", "vllm", "uid-lws", replicas=2)
LEADERS = obj("StatefulSet", "vllm", "uid-leaders", ("LeaderWorkerSet", "vllm", "uid-lws"))


@pytest.mark.parametrize(
    ("kind", "labels", "job", "expected"),
    [
        ("Job", {names.JOB_COMPLETION_INDEX_LABEL: "3"}, None, 3),
        ("Job", {}, None, None),
        # job-global-index x the Job's completions + the completion index.
        ("JobSet", {names.JOBSET_GLOBAL_INDEX_LABEL: "2", names.JOB_COMPLETION_INDEX_LABEL: "1"},
         {"spec": {"completions": 4}}, 9),
        ("JobSet", {names.JOBSET_GLOBAL_INDEX_LABEL: "2", names.JOB_COMPLETION_INDEX_LABEL: "1"},
         None, None),  # no Job to say how many pods it runs
        ("JobSet", {names.JOB_COMPLETION_INDEX_LABEL: "1"}, {"spec": {"completions": 4}}, None),
        ("StatefulSet", {names.STATEFULSET_POD_INDEX_LABEL: "5"}, None, 5),
    ],
)  # fmt: skip
def test_trainer_pods_are_numbered_from_their_controllers_labels(
    kind: str, labels: dict[str, str], job: dict[str, Any] | None, expected: int | None
) -> None:
    built = pod("p")
    for key, value in labels.items():
        built.label(key, value)
    assert trainer_ordinal(kind, built.build(), "t", job) == expected


def test_trainer_pod_counts_by_kind() -> None:
    assert trainer_pods("JobSet", JOBSET) == 4
    assert trainer_pods("Job", {"spec": {"completions": 3}}) == 3
    assert trainer_pods("StatefulSet", {"spec": {"replicas": 2}}) == 2
    assert trainer_pods("JobSet", {"spec": {"replicatedJobs": [{"replicas": 2}]}}) is None


def test_the_webhook_traces_leaders_and_jobset_pods_and_leaves_workers_alone() -> None:
    lookups = Lookups()
    lookups.statefulsets["vllm"] = {"kind": "LeaderWorkerSet", "name": "vllm"}
    lookups.statefulsets["vllm-0"] = {"kind": "Pod", "name": "vllm"}  # workers: the leader's
    lookups.jobs["train-workers-1"] = JOBS[1]
    lookups.jobs["solo"] = obj("Job", "solo", "uid-solo", completions=2)
    sync = jobset_sync(spec__trainer__sourceRanks=["all"])

    found = workload_of(leader(0), lookups)
    assert found == (WorkloadRef("LeaderWorkerSet", "vllm"), None)
    target = select_target(*found[:1], leader(0), [sync])
    assert target is not None
    assert (target.role, target.inference_index) == (Role.SINK, 0)

    assert workload_of(worker(0, 1), lookups) == (WorkloadRef("StatefulSet", "vllm-0"), None)
    assert select_target(WorkloadRef("StatefulSet", "vllm-0"), worker(0, 1), [sync]) is None

    found = workload_of(jobset_pod(1, 1), lookups)
    assert found == (WorkloadRef("JobSet", "train"), JOBS[1])
    target = select_target(found[0], jobset_pod(1, 1), [sync], found[1])
    assert target is not None
    assert (target.role, target.ordinal) == (Role.SOURCE, 3)

    solo = pod("solo-0").owned_by("Job", "solo").label(names.JOB_COMPLETION_INDEX_LABEL, "0")
    assert workload_of(solo.build(), lookups) == (WorkloadRef("Job", "solo"), lookups.jobs["solo"])


def test_only_source_ranks_of_a_jobset_get_a_sidecar() -> None:
    sync = jobset_sync(spec__trainer__sourceRanks=[0])
    ref = WorkloadRef("JobSet", "train")
    first = select_target(ref, jobset_pod(0, 0), [sync], JOBS[0])
    assert first is not None
    assert first.ordinal == 0
    assert select_target(ref, jobset_pod(1, 0), [sync], JOBS[1]) is None  # rank 2


def test_a_jobset_trainer_and_leaderworkerset_engines_make_one_group() -> None:
    sync = jobset_sync(spec__trainer__sourceRanks=["all"])
    world = World(
        trainer=JOBSET,
        engines={"vllm": LWS},
        controllers=[*JOBS, LEADERS],
        pods=[
            *(jobset_pod(j, c) for j in range(2) for c in range(2)),
            leader(0), leader(1), worker(0, 1), worker(1, 1),
            # A Job of another JobSet and a StatefulSet of another LWS do not count.
            pod("stray-0").owned_by("Job", "other", "uid-other-job")
            .label(names.JOB_COMPLETION_INDEX_LABEL, "0").running().build(),
        ],
    )  # fmt: skip
    views = sync_pods(sync, world)
    sources = [(v.name, v.rank) for v in views if v.role is Role.SOURCE]
    assert sources == [
        ("train-workers-0-0-x", 0), ("train-workers-0-1-x", 1),
        ("train-workers-1-0-x", 2), ("train-workers-1-1-x", 3),
    ]  # fmt: skip
    assert [(v.name, v.inference_index) for v in views if v.role is Role.SINK] == [
        ("vllm-0", 0),
        ("vllm-1", 0),
    ]
    assert world.inference_replicas == 2  # groups, not pods
    assert planned_sources(sync, world, views) == [0, 1, 2, 3]


def test_an_indexed_job_trainer_owns_its_pods() -> None:
    sync = parsed(spec__trainer__statefulSetRef=None, spec__trainer__jobRef={"name": "solo"},
                  spec__trainer__sourceRanks=["all"])  # fmt: skip
    job = obj("Job", "solo", "uid-solo", completions=2)
    pods = [
        pod(f"solo-{i}-x").owned_by("Job", "solo", "uid-solo")
        .label(names.JOB_COMPLETION_INDEX_LABEL, str(i)).running().build()
        for i in range(2)
    ]  # fmt: skip
    world = World(trainer=job, engines={"engine-a": None}, controllers=[], pods=pods)
    views = sync_pods(sync, world)
    assert [(v.name, v.rank) for v in views] == [("solo-0-x", 0), ("solo-1-x", 1)]
    assert unmet(sync, job, {"engine-a": None}) == (
        "DeploymentNotFound",
        "Deployment engine-a does not exist in this namespace.",
    )


def test_missing_workloads_and_ranks_beyond_are_named_by_kind() -> None:
    sync = jobset_sync(spec__trainer__sourceRanks=[4])
    assert unmet(sync, None, {"vllm": LWS}) == (
        "TrainerNotFound",
        "JobSet train does not exist in this namespace.",
    )
    assert unmet(sync, JOBSET, {"vllm": None}) == (
        "DeploymentNotFound",
        "LeaderWorkerSet vllm does not exist in this namespace.",
    )
    problem = unmet(sync, JOBSET, {"vllm": LWS})
    assert problem is not None
    assert "but JobSet train runs ranks 0 to 3" in problem[1]


def test_claims_are_by_kind_and_name() -> None:
    first = jobset_sync()
    second = parsed(name="b")  # StatefulSet trainer, Deployment engine-a
    third = jobset_sync(metadata__name="c")
    assert claim_conflicts(second, [first]) == []
    assert claim_conflicts(third, [first]) == [
        "JobSet train is already synced by WeightSync sync",
        "LeaderWorkerSet vllm is already synced by WeightSync sync",
    ]
