"""Membership planning: who joins, in which rank order, and when the generation bumps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.controller.builders import agent, sink_view, source_view, sync
from weightsync.api.control import AgentStatus, Backend, GenerationState
from weightsync.api.v1alpha1 import MemoryRelease, Role, SyncMode
from weightsync.controller.membership.plan import (
    JOIN_BATCH_SECONDS,
    Desired,
    Slot,
    build_plans,
    cold_members,
    desired_members,
    intact,
    needs_new_generation,
    newcomers_wait,
    next_generation,
    slots,
)
from weightsync.controller.membership.workloads import PodView

W, A, B, F = (
    GenerationState.WARM,
    GenerationState.ACTIVE,
    GenerationState.BROKEN,
    GenerationState.FORMING,
)


def names_of(members: tuple[PodView, ...]) -> list[str]:
    return [m.name for m in members]


def test_source_first_then_joinable_sinks_whose_agents_answer() -> None:
    pods = [
        sink_view("engine-a-2"),
        source_view(),
        sink_view("engine-a-1"),
        sink_view("engine-a-3", containers_ready=False),  # not ready yet
        sink_view("engine-a-4", has_agent=False),  # created while the webhook was away
        sink_view("engine-a-5", terminating=True),
        sink_view("engine-a-6"),  # its agent did not answer
    ]
    answering = {"trainer-0", "engine-a-1", "engine-a-2", "engine-a-3", "engine-a-5"}
    desired = desired_members(sync().spec, pods, answering, previous=[])
    assert names_of(desired.members) == ["trainer-0", "engine-a-1", "engine-a-2"]


def test_continuing_members_keep_their_order_and_newcomers_append() -> None:
    pods = [source_view(), *(sink_view(f"engine-a-{i}") for i in range(1, 5))]
    previous = [
        Slot(0, "trainer-0", Role.SOURCE),
        Slot(1, "engine-a-3", Role.SINK),
        Slot(2, "engine-a-1", Role.SINK),
    ]
    desired = desired_members(sync().spec, pods, {p.name for p in pods}, previous)
    assert names_of(desired.members) == [
        "trainer-0",
        "engine-a-3",
        "engine-a-1",
        "engine-a-2",
        "engine-a-4",
    ]


def test_sinks_of_earlier_inference_entries_come_first_among_newcomers() -> None:
    pods = [source_view(), sink_view("a-1", index=1), sink_view("z-1", index=0)]
    desired = desired_members(sync().spec, pods, {p.name for p in pods}, [])
    assert names_of(desired.members) == ["trainer-0", "z-1", "a-1"]


@pytest.mark.parametrize(
    ("pods", "answering", "waiting_for"),
    [
        ([sink_view("e-1")], {"e-1"}, "source agent of trainer rank 0"),
        ([source_view(), sink_view("e-1")], {"e-1"}, "source agent of trainer rank 0"),
        ([source_view()], {"trainer-0"}, "ready inference pod"),
        ([source_view(ordinal=1), sink_view("e-1")], {"trainer-0", "e-1"}, "trainer rank 0"),
    ],
)
def test_no_group_without_a_source_or_a_sink(
    pods: list[PodView], answering: set[str], waiting_for: str
) -> None:
    desired = desired_members(sync().spec, pods, answering, [])
    assert not desired.formable
    assert waiting_for in desired.waiting_for
    assert not needs_new_generation(desired, [], None, {})


def test_colocated_groups_hold_only_the_source_and_name_an_engine_on_its_node() -> None:
    spec = sync(spec__mode="Colocated").spec
    pods = [
        source_view(),
        sink_view("e-far", node="node-b"),  # another node: no CUDA IPC to it
        sink_view("e-2", ip="10.0.1.2"),
        sink_view("e-1", ip="10.0.1.1"),
        sink_view("e-0", ip="10.0.1.0", running=False),  # not joinable
    ]
    answering = {p.name for p in pods}
    desired = desired_members(spec, pods, answering, [])
    assert names_of(desired.members) == ["trainer-0"]
    assert desired.engine_pod == "e-1"  # by entry, then name
    kept = desired_members(spec, pods, answering, [], previous_engine="e-2")
    assert kept.engine_pod == "e-2"  # the planned engine stays while joinable
    # A different engine pod is a new generation, like a different member.
    planned = list(slots(desired.members))
    statuses = {"trainer-0": agent("trainer-0", Role.SOURCE, generations={3: (W, 0)})}
    assert not needs_new_generation(desired, planned, 3, statuses, planned_engine="e-1")
    assert needs_new_generation(kept, planned, 3, statuses, planned_engine="e-1")
    # No engine on the node: no group (the source alone would sync nothing).
    alone = desired_members(spec, [source_view(), pods[1]], answering, [])
    assert not alone.formable
    assert "node-a" in alone.waiting_for


def test_colocated_groups_hold_every_rank_of_the_trainer_pod_and_the_lead_drives() -> None:
    spec = sync(
        spec__mode="Colocated", spec__trainer__sourceRanks=["all"], spec__trainer__ranksPerPod=2
    ).spec
    ranks = [source_view(f"trainer-0[{r}]", rank=r) for r in (0, 1)]
    engine = sink_view("e-1", ip="10.0.1.1")
    pods = [*ranks, engine]
    desired = desired_members(spec, pods, {p.name for p in pods}, [], sources=[0, 1])
    assert names_of(desired.members) == ["trainer-0[0]", "trainer-0[1]"]
    assert desired.engine_pod == "e-1"
    plans = build_plans(
        sync_name="ns/sync", spec=spec, generation=2, members=list(desired.members),
        rendezvous_port=29470, engine=engine,
    )  # fmt: skip
    assert [(p.world_size, p.source_count, p.holder) for p in plans] == [
        (2, 2, True),
        (2, 2, False),
    ]
    assert {p.local_engine.pod if p.local_engine else None for p in plans} == {"e-1"}
    # A rank on another node (a trainer of two pods under [all]): no group, and why.
    apart = [ranks[0], source_view("trainer-1[0]", rank=2, node="node-b"), engine]
    split = desired_members(spec, apart, {p.name for p in apart}, [], sources=[0, 2])
    assert not split.formable
    assert "trainer-1[0]" in split.waiting_for


def test_a_colocated_plan_tells_the_source_where_its_engine_listens() -> None:
    spec = sync(
        spec__mode="Colocated",
        spec__inference=[
            {
                "deploymentRef": {"name": "engine-a"},
                "engine": "SGLang",
                "port": 30000,
                "pauseMode": "Keep",
                "flushCache": False,
            }
        ],
    ).spec
    engine = sink_view("e-1", ip="10.0.1.1")
    (plan,) = build_plans(
        sync_name="ns/sync",
        spec=spec,
        generation=2,
        members=[source_view()],
        rendezvous_port=29470,
        engine=engine,
    )
    assert plan.mode is SyncMode.COLOCATED
    local = plan.local_engine
    assert local is not None
    assert (local.pod, local.engine, local.url) == ("e-1", "SGLang", "http://10.0.1.1:30000")
    assert (local.options.pause_mode.value, local.options.flush_cache) == ("Keep", False)
    disaggregated = build_plans(
        sync_name="ns/sync", spec=sync().spec, generation=2, members=[source_view(), engine],
        rendezvous_port=29470,
    )  # fmt: skip
    assert [p.local_engine for p in disaggregated] == [None, None]
    assert local.memory_release is MemoryRelease.NONE  # the default: release() frees nothing


@pytest.mark.parametrize("release", list(MemoryRelease))
def test_a_colocated_plan_says_what_the_engine_releases_between_rounds(
    release: MemoryRelease,
) -> None:
    spec = sync(spec__mode="Colocated", spec__colocated={"memoryRelease": release.value}).spec
    (plan,) = build_plans(
        sync_name="ns/sync", spec=spec, generation=2, members=[source_view()],
        rendezvous_port=29470, engine=sink_view("e-1", ip="10.0.1.1"),
    )  # fmt: skip
    assert plan.local_engine is not None
    assert plan.local_engine.memory_release is release


def test_excluded_pods_sit_out() -> None:
    pods = [source_view(), sink_view("e-1"), sink_view("e-2")]
    desired = desired_members(sync().spec, pods, {p.name for p in pods}, [], excluded={"e-2"})
    assert names_of(desired.members) == ["trainer-0", "e-1"]


def group_of_three() -> tuple[Desired, list[Slot], dict[str, AgentStatus]]:
    pods = [source_view(), sink_view("e-1"), sink_view("e-2")]
    desired = desired_members(sync().spec, pods, {p.name for p in pods}, [])
    planned = list(slots(desired.members))
    statuses = {
        "trainer-0": agent("trainer-0", Role.SOURCE, generations={4: (A, 0)}),
        "e-1": agent("e-1", generations={4: (A, 1)}),
        "e-2": agent("e-2", generations={3: (GenerationState.RETIRED, 1), 4: (W, 2)}),
    }
    return desired, planned, statuses


def test_a_held_generation_with_the_same_members_is_kept() -> None:
    desired, planned, statuses = group_of_three()
    assert not needs_new_generation(desired, planned, 4, statuses)


def test_membership_change_or_an_agent_that_lost_the_generation_bumps_it() -> None:
    desired, planned, statuses = group_of_three()
    assert needs_new_generation(desired, planned[:2], 4, statuses)  # a newcomer, all warm
    source, first, second = desired.members
    assert needs_new_generation(Desired((source, first)), planned, 4, statuses)  # one left
    assert needs_new_generation(Desired((source, second, first)), planned, 4, statuses)
    renamed = [*planned[:2], Slot(2, "e-3", Role.SINK)]
    assert needs_new_generation(desired, renamed, 4, statuses)
    assert needs_new_generation(desired, planned, None, statuses)
    restarted = {**statuses, "e-1": agent("e-1")}  # a restarted sidecar holds nothing
    assert needs_new_generation(desired, planned, 4, restarted)
    broken = {**statuses, "e-2": agent("e-2", generations={4: (B, 2)})}
    assert needs_new_generation(desired, planned, 4, broken)
    moved = {**statuses, "e-2": agent("e-2", generations={4: (W, 1)})}  # wrong rank
    assert needs_new_generation(desired, planned, 4, moved)


def test_a_spec_change_since_planning_bumps_the_generation() -> None:
    desired, planned, statuses = group_of_three()
    assert needs_new_generation(desired, planned, 4, statuses, planned_from_older_spec=True)
    not_formable = desired_members(sync().spec, [], set(), [])
    assert not needs_new_generation(
        not_formable, planned, 4, statuses, planned_from_older_spec=True
    )


def test_the_next_generation_is_past_anything_any_agent_has_seen() -> None:
    _, _, statuses = group_of_three()
    assert next_generation(4, statuses) == 5
    assert next_generation(2, statuses) == 5  # a lost status write
    assert next_generation(None, {}) == 1


def test_cold_members_took_the_plan_and_did_not_warm_it() -> None:
    _, planned, statuses = group_of_three()
    statuses["e-1"] = agent("e-1", generations={4: (F, 1)})
    assert [s.pod for s in cold_members(planned, 4, statuses)] == ["e-1"]
    # Nobody lists generation 5: nobody got it (replaced pods, restarted agents) and a new
    # plan is what they need, not a cooldown; an agent that does not answer is unknown.
    assert cold_members(planned, 5, statuses) == []
    del statuses["e-2"]
    statuses["trainer-0"] = agent("trainer-0", Role.SOURCE)  # a replaced trainer pod
    assert [s.pod for s in cold_members(planned, 4, statuses)] == ["e-1"]


def test_plans_are_valid_control_messages_addressed_to_each_rank() -> None:
    spec = sync(
        spec__transfer={
            "bucketSizeBytes": 1 << 20,
            "pipelineDepth": 3,
            "timeoutSeconds": 9,
            "checksum": True,
        }
    ).spec
    members = [
        source_view(ip="10.0.0.9"),
        sink_view("e-1", ip="10.0.1.1"),
        sink_view("e-2", ip="10.0.1.2"),
    ]
    plans = build_plans(
        sync_name="ns/sync", spec=spec, generation=7, members=members, rendezvous_port=29470
    )
    assert [p.rank for p in plans] == [0, 1, 2]
    first = plans[0]
    # The source gets the roster; a sink only its own entry, the group's size and the
    # rendezvous: a generation's plans are O(members) bytes in all.
    assert [p.has_roster for p in plans] == [True, False, False]
    assert [(p.world_size, p.source_count) for p in plans] == [(3, 1)] * 3
    assert [p.members for p in plans[1:]] == [[first.members[1]], [first.members[2]]]
    assert [(m.pod, m.host, m.role) for m in first.members] == [
        ("trainer-0", "10.0.0.9", Role.SOURCE),
        ("e-1", "10.0.1.1", Role.SINK),
        ("e-2", "10.0.1.2", Role.SINK),
    ]
    assert (first.rendezvous.host, first.rendezvous.port) == ("10.0.0.9", 29470)
    assert first.generation == 7
    assert first.backend is Backend.GLOO
    assert first.mode is SyncMode.DISAGGREGATED
    assert first.transfer.bucket_size_bytes == 1 << 20
    assert first.transfer.pipeline_depth == 3
    assert first.transfer.timeout_seconds == 9.0
    assert first.transfer.checksum
    assert first.prewarm_timeout_seconds == 120.0


def test_nccl_only_when_every_member_is_on_a_gpu() -> None:
    gpu = [replace(source_view(), device="cuda:0"), replace(sink_view("e-1"), device="cuda:0")]
    plans = build_plans(
        sync_name="s", spec=sync().spec, generation=1, members=gpu, rendezvous_port=1
    )
    assert plans[0].backend is Backend.NCCL
    mixed = [gpu[0], sink_view("e-2")]
    plans = build_plans(
        sync_name="s", spec=sync().spec, generation=1, members=mixed, rendezvous_port=1
    )
    assert plans[0].backend is Backend.GLOO


@pytest.mark.parametrize(
    ("recovery", "holders"),
    [
        ({"holders": 1}, [True, False, False]),
        ({"holders": 2}, [True, True, False]),
        ({"holders": 8}, [True, True, True]),
        ({"holders": 3, "enabled": False}, [False, False, False]),
    ],
)
def test_the_source_and_the_lowest_sink_ranks_hold(
    recovery: dict[str, object], holders: list[bool]
) -> None:
    members = [source_view(), sink_view("engine-a", ip="10.0.1.1"), sink_view("engine-b")]
    plans = build_plans(
        sync_name="ns/sync",
        spec=sync(spec__recovery=recovery).spec,
        generation=4,
        members=members,
        rendezvous_port=29500,
    )
    assert [plan.holder for plan in plans] == holders


def test_a_colocated_source_holds_for_its_engine_reloads_unless_recovery_is_off() -> None:
    """It reloads a restarted engine from the held copy (`agent.local_reload`)."""
    for recovery, holds in (({}, True), ({"enabled": False}, False)):
        (plan,) = build_plans(
            sync_name="ns/sync",
            spec=sync(spec__mode="Colocated", spec__recovery=recovery).spec,
            generation=1,
            members=[source_view()],
            rendezvous_port=29500,
            engine=sink_view("e-1"),
        )
        assert plan.holder is holds


def test_every_source_rank_joins_first_in_rank_order() -> None:
    """A sharded trainer: every listed rank is a source member, ranks 0..n-1 by ordinal."""
    spec = sync(spec__trainer__sourceRanks=[2, 0, 1], spec__recovery__holders=2).spec
    trainers = [source_view(f"trainer-{i}", ip=f"10.0.0.{i + 1}", ordinal=i) for i in (1, 2, 0)]
    pods = [sink_view("e-1"), *trainers, source_view("trainer-3", ordinal=3)]
    answering = {p.name for p in pods}
    desired = desired_members(spec, pods, answering, [])
    assert names_of(desired.members) == ["trainer-0", "trainer-1", "trainer-2", "e-1"]
    plans = build_plans(
        sync_name="ns/sync", spec=spec, generation=1, members=desired.members,
        rendezvous_port=29470,
    )  # fmt: skip
    assert plans[0].source_count == 3
    assert plans[0].rendezvous.host == "10.0.0.1"  # trainer-0's agent hosts the store
    # Holders: the lead source and then sinks, never a second copy on another source.
    assert [plan.holder for plan in plans] == [True, False, False, True]
    # A missing rank holds the group back, named.
    waiting = desired_members(spec, pods, answering - {"trainer-2"}, [])
    assert not waiting.formable
    assert "trainer rank 2" in waiting.waiting_for


def test_a_thousand_sinks_cost_kilobytes_not_megabytes_of_plans() -> None:
    members = [source_view(), *(sink_view(f"engine-{i}", ip=f"10.1.{i // 250}.{i % 250}")
                                for i in range(1000))]  # fmt: skip
    plans = build_plans(
        sync_name="ns/sync", spec=sync().spec, generation=2, members=members,
        rendezvous_port=29470,
    )  # fmt: skip
    total = sum(len(plan.model_dump_json()) for plan in plans)
    assert total < 2_000_000  # each sink carrying the roster was 80 MB
    assert len(plans[0].model_dump_json()) > 50 * len(plans[1].model_dump_json())


def test_a_member_whose_poll_timed_out_keeps_its_place_a_newcomer_waits() -> None:
    _desired, planned, statuses = group_of_three()
    pods = [source_view(), sink_view("e-1"), sink_view("e-2"), sink_view("e-3")]
    silent = {"e-1", "e-3"}
    answering = {p.name for p in pods} - silent
    kept = desired_members(sync().spec, pods, answering, planned, unknown=silent)
    assert names_of(kept.members) == ["trainer-0", "e-1", "e-2"]  # e-3 is no member yet
    assert not needs_new_generation(kept, planned, 4, {k: statuses[k] for k in answering - {"e-3"}})
    # Without the benefit of the doubt, e-1 would be dropped and the group re-formed.
    dropped = desired_members(sync().spec, pods, answering, planned)
    assert names_of(dropped.members) == ["trainer-0", "e-2"]


def test_only_an_answer_shows_a_generation_gone() -> None:
    _, planned, statuses = group_of_three()
    assert intact(planned, 4, statuses)
    assert intact(planned, 4, {})  # nobody answered since: no evidence
    restarted = {**statuses, "e-1": agent("e-1")}
    assert not intact(planned, 4, restarted)
    assert not intact(planned, None, statuses)


def test_newcomers_wait_while_the_planned_generation_still_forms() -> None:
    _, planned, statuses = group_of_three()
    pods = [source_view(), sink_view("e-1"), sink_view("e-2"), sink_view("e-3")]
    grown = desired_members(sync().spec, pods, {p.name for p in pods}, planned)
    assert names_of(grown.members) == ["trainer-0", "e-1", "e-2", "e-3"]
    source_forming = agent("trainer-0", Role.SOURCE, generations={4: (F, 0)})
    forming = {
        **statuses,
        "trainer-0": source_forming,
        "e-1": agent("e-1", generations={4: (F, 1)}),
    }
    assert not needs_new_generation(grown, planned, 4, forming)  # e-3 joins the next one
    assert needs_new_generation(grown, planned, 4, statuses)  # warm everywhere: now
    # The source warm is the pre-warm passed on every member: a member's own answer
    # still saying forming was given before that.
    late = {**statuses, "e-1": agent("e-1", generations={4: (F, 1)})}
    assert needs_new_generation(grown, planned, 4, late)
    # A member lost is no reason to wait.
    shrunk = desired_members(sync().spec, pods[:2], {"trainer-0", "e-1"}, planned)
    assert needs_new_generation(shrunk, planned, 4, forming)


def test_newcomers_wait_a_while_for_more_pods_on_their_way() -> None:
    """A scale-up forms a few generations: a ready newcomer waits (at most
    JOIN_BATCH_SECONDS) while another inference pod is still starting or recovering."""
    _, planned, statuses = group_of_three()
    starting = sink_view("e-4", running=False)
    pods = [source_view(), sink_view("e-1"), sink_view("e-2"), sink_view("e-3"), starting]
    grown = desired_members(sync().spec, pods, {p.name for p in pods}, planned)
    assert names_of(grown.members) == ["trainer-0", "e-1", "e-2", "e-3"]
    assert newcomers_wait(pods, grown, planned, cooling=(), waiting_for=1.0, replicas=4)
    assert not needs_new_generation(grown, planned, 4, statuses, batching=True)
    assert needs_new_generation(grown, planned, 4, statuses, batching=False)
    # Not past the bound, not for a pod sitting out, not for one leaving (scaled in).
    assert not newcomers_wait(
        pods, grown, planned, cooling=(), waiting_for=JOIN_BATCH_SECONDS, replicas=4
    )
    assert not newcomers_wait(pods, grown, planned, cooling={"e-4"}, waiting_for=1.0, replicas=4)
    leaving = [*pods[:-1], replace(starting, terminating=True)]
    assert not newcomers_wait(leaving, grown, planned, cooling=(), waiting_for=1.0, replicas=3)
    # Pods the Deployments ask for that do not exist yet are on their way too.
    ready = pods[:-1]
    assert not newcomers_wait(ready, grown, planned, cooling=(), waiting_for=1.0, replicas=3)
    assert newcomers_wait(ready, grown, planned, cooling=(), waiting_for=1.0, replicas=4)
    # A member lost is no reason to wait, whatever is on its way.
    shrunk = desired_members(sync().spec, pods[:2], {"trainer-0", "e-1"}, planned)
    assert needs_new_generation(shrunk, planned, 4, statuses, batching=True)
