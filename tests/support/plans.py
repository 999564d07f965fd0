"""Membership plans for groups of local agents (tests and benchmarks), built one way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync.api.control import (
    Backend,
    LocalEngine,
    MembershipPlan,
    PlanMember,
    Rendezvous,
    TransferOptions,
)
from weightsync.api.v1alpha1 import Role, SyncMode


def plan_body(**overrides: Any) -> dict[str, Any]:
    """A valid `PUT /v1/plan` body as JSON data, rank 1 (the sink `infer-a`) of two, with
    `overrides` on top: what tests of the message's parsing start from."""
    body: dict[str, Any] = {
        "sync_name": "demo",
        "generation": 1,
        "rank": 1,
        "backend": "gloo",
        "rendezvous": {"host": "10.0.0.1", "port": 29500},
        "members": [
            {"rank": 0, "pod": "trainer-0", "host": "10.0.0.1", "role": "source"},
            {"rank": 1, "pod": "infer-a", "host": "10.0.0.2", "role": "sink"},
        ],
    }
    return {**body, **overrides}


def local_plan(
    pods: Sequence[str],
    rank: int,
    *,
    generation: int,
    port: int,
    backend: Backend,
    transfer: TransferOptions,
    sync_name: str = "local",
    mode: SyncMode = SyncMode.DISAGGREGATED,
    local_engine: LocalEngine | None = None,
    prewarm_timeout_seconds: float = 30.0,
    sources: int = 1,
) -> MembershipPlan:
    """The plan for `rank` of a group whose agents all listen on 127.0.0.1 (rendezvous on
    `port`): the first `sources` pods are source ranks, the others sinks, ranked in order.
    As the operator sends them: the roster to sources, a compact plan (their own entry
    and the group's size) to sinks."""
    members = [
        PlanMember(
            rank=i, pod=pod, host="127.0.0.1", role=Role.SOURCE if i < sources else Role.SINK
        )
        for i, pod in enumerate(pods)
    ]
    compact = rank >= sources
    return MembershipPlan(
        sync_name=sync_name,
        generation=generation,
        rank=rank,
        backend=backend,
        mode=mode,
        rendezvous=Rendezvous(host="127.0.0.1", port=port),
        members=[members[rank]] if compact else members,
        world_size=len(members),
        source_count=sources,
        transfer=transfer,
        prewarm_timeout_seconds=prewarm_timeout_seconds,
        local_engine=local_engine,
    )
