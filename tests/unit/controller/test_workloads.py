"""Which pods belong to which WeightSync: owner chains, claims, and the webhook's choices."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.unit.api.builders import weightsync
from tests.unit.controller.builders import pod, sink_view, sync
from weightsync.api.v1alpha1 import Role, TrainerKind
from weightsync.controller.admission.review import claim_errors, older_than, workload_of
from weightsync.controller.cluster.kube import selector_string
from weightsync.controller.cluster.pod_actions import RECREATE_AFTER, uninjected
from weightsync.controller.membership.owners import (
    WorkloadRef,
    claim_conflicts,
    select_target,
    statefulset_ordinal,
)
from weightsync.controller.membership.workloads import (
    PodView,
    World,
    parse_time,
    pods_to_recreate,
    sync_pods,
)


def owned(
    kind: str, name: str, uid: str, owner: tuple[str, str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid}
    if owner:
        meta["ownerReferences"] = [
            {"kind": owner[0], "name": owner[1], "uid": owner[2], "controller": True}
        ]
    return {"kind": kind, "metadata": meta}


def test_pods_are_matched_by_controller_uid_not_by_name_or_labels() -> None:
    world = World(
        trainer=owned("StatefulSet", "trainer", "sts-new"),
        engines={"engine-a": owned("Deployment", "engine-a", "dep-a")},
        controllers=[
            owned("ReplicaSet", "engine-a-1", "rs-1", ("Deployment", "engine-a", "dep-a")),
            owned("ReplicaSet", "engine-a-0", "rs-0", ("Deployment", "engine-a", "dep-old")),
        ],
        pods=[
            pod("trainer-0").owned_by("StatefulSet", "trainer", "sts-new").build(),
            pod("trainer-1").owned_by("StatefulSet", "trainer", "sts-new").build(),  # not a source
            pod("trainer-2").owned_by("StatefulSet", "trainer", "sts-old").build(),
            pod("engine-a-1-x").owned_by("ReplicaSet", "engine-a-1", "rs-1").build(),
            pod("engine-a-0-y").owned_by("ReplicaSet", "engine-a-0", "rs-0").build(),
            pod("stray").label("app", "engine-a").build(),
        ],
    )
    views = sync_pods(sync(), world)
    assert [(v.name, v.role, v.workload) for v in views] == [
        ("trainer-0", Role.SOURCE, "trainer"),
        ("engine-a-1-x", Role.SINK, "engine-a"),
    ]


def test_statefulset_ordinals_prefer_the_pod_index_label() -> None:
    assert statefulset_ordinal(pod("trainer-3").build(), "trainer") == 3
    labelled = pod("odd-name").label("apps.kubernetes.io/pod-index", "5").build()
    assert statefulset_ordinal(labelled, "trainer") == 5
    assert statefulset_ordinal(pod("other-3").build(), "trainer") is None


def test_webhook_targets_source_ranks_and_inference_pods_only() -> None:
    syncs = [sync("b"), sync("a", spec__trainer__sourceRanks=[1])]
    trainer_1 = pod("trainer-1").build()
    target = select_target(WorkloadRef("StatefulSet", "trainer"), trainer_1, syncs)
    assert target is not None
    assert (target.sync.metadata.name, target.role, target.ordinal) == ("a", Role.SOURCE, 1)
    assert (
        select_target(WorkloadRef("StatefulSet", "trainer"), pod("trainer-0").build(), syncs)
        is None
    )
    target = select_target(WorkloadRef("Deployment", "engine-a"), pod("x").build(), syncs)
    assert target is not None
    assert (target.sync.metadata.name, target.role, target.inference_index) == ("a", Role.SINK, 0)
    assert select_target(WorkloadRef("Deployment", "other"), pod("x").build(), syncs) is None


class Lookups:
    """`OwnerLookups` over a few objects, recording what was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.statefulsets: dict[str, dict[str, Any]] = {}

    def replicaset_owner(self, name: str) -> str | None:
        self.asked.append(name)
        return "engine-a" if name == "engine-a-7d9" else None

    def statefulset_owner(self, name: str) -> dict[str, Any] | None:
        self.asked.append(name)
        return self.statefulsets.get(name)

    def job(self, name: str) -> dict[str, Any] | None:
        self.asked.append(name)
        return self.jobs.get(name)


def test_a_deployment_pod_is_traced_through_its_replicaset() -> None:
    owner = Lookups()
    rs_pod = pod("").owned_by("ReplicaSet", "engine-a-7d9").build()
    assert workload_of(rs_pod, owner) == (WorkloadRef("Deployment", "engine-a"), None)
    assert workload_of(pod("").owned_by("ReplicaSet", "bare-rs").build(), owner) is None
    assert workload_of(pod("t-0").owned_by("StatefulSet", "t").build(), owner) == (
        WorkloadRef("StatefulSet", "t"),
        None,
    )
    assert workload_of(pod("naked").build(), owner) is None
    assert owner.asked == ["engine-a-7d9", "bare-rs", "t"]


def test_claims_conflict_on_shared_workloads_and_the_older_wins() -> None:
    first = sync("first")
    second = sync("second", spec__trainer__statefulSetRef={"name": "other"})
    assert claim_conflicts(second, [first]) == [
        "Deployment engine-a is already synced by WeightSync first"
    ]
    assert claim_conflicts(first, [first]) == []
    raws = [
        {"metadata": {"name": "a", "creationTimestamp": "2026-01-01T00:00:00Z"}},
        {"metadata": {"name": "b", "creationTimestamp": "2026-01-02T00:00:00Z"}},
    ]
    assert [o["metadata"]["name"] for o in older_than(raws[1], raws)] == ["a"]
    assert older_than(raws[0], raws) == []
    being_created = {"metadata": {"name": "c"}}
    assert len(older_than(being_created, raws)) == 2


def test_validating_webhook_refuses_only_new_claims_on_taken_workloads() -> None:
    older = weightsync("first").namespace("ns").build()
    older["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    newcomer = weightsync("second").namespace("ns").build()
    assert claim_errors(newcomer, None, [older]) == [
        "Deployment engine-a is already synced by WeightSync first",
        "StatefulSet trainer is already synced by WeightSync first",
    ]
    separate = weightsync("third").namespace("ns").set("spec.trainer.statefulSetRef.name", "t2")
    separate.set("spec.inference.0.deploymentRef.name", "engine-b")
    assert claim_errors(separate.build(), None, [older]) == []
    # The operator's own metadata writes and deletions are never refused.
    assert claim_errors(newcomer, newcomer, [older]) == []
    deleting = {**newcomer, "metadata": {**newcomer["metadata"], "deletionTimestamp": "x"}}
    assert claim_errors(deleting, None, [older]) == []


def test_an_older_weightsync_patched_to_take_a_newer_ones_workload_is_refused() -> None:
    first = weightsync("first").namespace("ns").set("spec.inference.0.deploymentRef.name", "a")
    older = first.build()
    older["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    second = weightsync("second").namespace("ns").set("spec.trainer.statefulSetRef.name", "t2")
    newer = second.set("spec.inference.0.deploymentRef.name", "b").build()
    newer["metadata"]["creationTimestamp"] = "2026-01-02T00:00:00Z"
    grabbing = weightsync("first").namespace("ns").set("spec.inference.0.deploymentRef.name", "b")
    patched = grabbing.build()
    patched["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    assert claim_errors(patched, older, [older, newer]) == [
        "Deployment b is already synced by WeightSync second"
    ]
    # What it named before stays its own, even where a newer one names it too (admitted
    # while the webhook was away): an unrelated change is not refused for it.
    squatter = weightsync("third").namespace("ns").set("spec.inference.0.deploymentRef.name", "a")
    squatting = squatter.set("spec.trainer.statefulSetRef.name", "t3").build()
    squatting["metadata"]["creationTimestamp"] = "2026-01-03T00:00:00Z"
    retimed = first.set("spec.transfer.timeoutSeconds", 90).build()
    retimed["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    assert claim_errors(retimed, older, [older, newer, squatting]) == []


def test_only_opted_in_pods_the_webhook_missed_and_would_inject_now_are_recreated() -> None:
    made = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def view(name: str, created: datetime, **changes: Any) -> PodView:
        return replace(sink_view(name, has_agent=False, labelled=True, created=created), **changes)

    pods = [
        view("together", made - timedelta(seconds=3)),
        view("same-second", made),
        view("long-running", made - timedelta(hours=2)),  # a serving pod: never restarted
        view("after", made + timedelta(seconds=5)),  # webhook outage: reported, not deleted
        view("not-opted-in", made - timedelta(seconds=3), labelled=False),
        view("injected", made - timedelta(seconds=3), has_agent=True),
        view("leaving", made - timedelta(seconds=3), terminating=True),
    ]
    chosen = pods_to_recreate(pods, made, timedelta(minutes=5))
    assert [p.name for p in chosen] == ["together", "same-second"]
    assert pods_to_recreate(pods, None, timedelta(minutes=5)) == []
    # An operator that started 6.5 s after the WeightSync: pods admitted while its
    # webhook settled met no webhook and are recreated; pods created before it started
    # (an outage, like "after") or after it settled are left to the report.
    settling = (made + timedelta(seconds=6.5), made + timedelta(seconds=21))
    late = [
        view("in-the-settling", made + timedelta(seconds=6)),  # whole seconds: 6.5 -> 6
        view("during-the-outage", made + timedelta(seconds=2)),
        view("after-it-settled", made + timedelta(seconds=22)),
    ]
    chosen = pods_to_recreate([*pods, *late], made, timedelta(minutes=5), settling)
    assert [p.name for p in chosen] == ["together", "same-second", "in-the-settling"]


def test_timestamps_in_both_spellings() -> None:
    expected = datetime(2026, 1, 1, 12, 0, 5, tzinfo=UTC)
    assert parse_time("2026-01-01T12:00:05Z") == expected
    assert parse_time("2026-01-01T12:00:05+00:00") == expected
    assert parse_time(None) is None


def test_label_selectors_as_query_strings() -> None:
    selector = {
        "matchLabels": {"app": "engine", "tier": "gpu"},
        "matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["a", "b"]},
            {"key": "canary", "operator": "DoesNotExist"},
            {"key": "team", "operator": "Exists"},
            {"key": "stage", "operator": "NotIn", "values": ["dev"]},
        ],
    }
    assert selector_string(selector) == (
        "app=engine,tier=gpu,zone in (a,b),!canary,team,stage notin (dev)"
    )
    assert selector_string(None) == ""


def test_the_inference_replicas_are_what_the_found_deployments_ask_for() -> None:
    wanted = {**owned("Deployment", "engine-a", "dep-a"), "spec": {"replicas": 3}}
    scaled_to_zero = {**owned("Deployment", "engine-b", "dep-b"), "spec": {"replicas": 0}}
    world = World(
        trainer=None,
        engines={"engine-a": wanted, "engine-b": scaled_to_zero, "engine-c": None},
        controllers=[],
        pods=[],
    )
    assert world.inference_replicas == 3


def test_a_job_or_jobset_trainer_pod_the_webhook_missed_is_reported_never_deleted() -> None:
    """The e2e with the JobSet controller: the trainer pod, created a moment before its
    WeightSync, was deleted to be recreated with the sidecar; its Job counted it failed
    (backoffLimit 0) and the JobSet failed as a whole. Engines are still recreated."""
    raw = {"metadata": {"creationTimestamp": "2026-01-01T12:00:00Z"}}
    made = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    missed = {"has_agent": False, "labelled": True, "created": made - timedelta(seconds=1)}
    engine = replace(sink_view("engine-0"), **missed)
    trainer = replace(sink_view("trainer-workers-0-0"), role=Role.SOURCE, **missed)
    later = made + timedelta(seconds=10)
    for kind in (TrainerKind.JOB_SET, TrainerKind.JOB):
        assert uninjected(raw, [trainer, engine], None, kind, later) == ([engine], False)
    assert uninjected(raw, [trainer, engine], None, TrainerKind.STATEFUL_SET, later) == (
        [trainer, engine],
        False,
    )


def test_a_pod_the_webhook_missed_is_recreated_once_its_controller_surely_saw_it() -> None:
    """CI saw a Colocated engine pod deleted 0.15 s after its creation: its ReplicaSet had
    not seen it created, and made no other for the 5 minutes of its expectations. A pod
    younger than `RECREATE_AFTER` waits, and the pass asks for a follow-up."""
    raw = {"metadata": {"creationTimestamp": "2026-01-01T12:00:00Z"}}
    made = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    engine = replace(sink_view("engine-0"), has_agent=False, labelled=True, created=made)
    kind = TrainerKind.STATEFUL_SET
    assert uninjected(raw, [engine], None, kind, made + timedelta(seconds=0.2)) == ([], True)
    assert uninjected(raw, [engine], None, kind, made + RECREATE_AFTER) == ([engine], False)
