"""Group membership: who is in the next generation, with which rank, and when to bump it. Pure.

A generation is a fixed list of members (rank 0 is the trainer's source agent, which
hosts the rendezvous store; sinks follow). The operator plans a new generation when
the list it wants differs from the planned one, or when some member's agent does not
hold the planned generation any more (it restarted, or the generation broke). The
number is one more than the largest the operator or any agent has seen, so a status
write lost after a plan was delivered can never make the operator reuse a number.

Ranks are kept stable across generations: continuing members keep their relative
order and newcomers are appended, so a scale-up does not reshuffle the group.

Colocated groups have the source ranks (one rank, or every rank of one trainer pod) as
their only members, and name the engine the lead (rank 0) hands buckets to
(`LocalEngine`): a joinable inference pod on the sources' node (the webhook
gives inference pods a required affinity to it), the one planned before while it stays
joinable. A new engine pod is a new generation, as a new member would be.

Holders (P2P recovery): the source agent keeps the latest committed version in host
memory; `spec.recovery.holders` > 1 asks the lowest-ranked sinks for the rest. Plans
decide (the webhook sets `WEIGHTSYNC_HOLDER=false` on every agent); with recovery off
nobody holds, since a held copy costs a device-to-host copy of the model every round; in
a Colocated group only the source, which reloads its engine from it. The
lowest ranks are the longest-serving members, so the choice changes only when a holder
leaves the group.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from weightsync.api.control import (
    AgentStatus,
    Backend,
    GenerationState,
    MembershipPlan,
    PlanMember,
    Rendezvous,
    TransferOptions,
)
from weightsync.api.v1alpha1 import Role, SyncMode, WeightSyncSpec
from weightsync.controller.membership.colocated import local_engine
from weightsync.controller.membership.workloads import PodView

# Newcomers wait this long at most for other inference pods still on their way (starting,
# recovering) before a generation is planned for them: a scale-up of hundreds of pods,
# ready over a minute, forms a few generations (each a new communicator for every
# member), not one per sweep. Bounded: a pod that never starts holds nobody for long.
JOIN_BATCH_SECONDS = 10.0

HOLDING_STATES = frozenset({GenerationState.FORMING, GenerationState.WARM, GenerationState.ACTIVE})
WARM_STATES = frozenset({GenerationState.WARM, GenerationState.ACTIVE})


@dataclass(frozen=True, slots=True)
class Slot:
    """One rank of a planned generation, as the status records it (pod name and role)."""

    rank: int
    pod: str
    role: Role


@dataclass(frozen=True, slots=True)
class Desired:
    """The members the operator wants now, in rank order, or why there are none."""

    members: tuple[PodView, ...]
    waiting_for: str = ""  # non-empty: no group can be formed yet, and why
    engine: PodView | None = None  # Colocated: the inference pod the source hands off to

    @property
    def engine_pod(self) -> str | None:
        return self.engine.name if self.engine is not None else None

    @property
    def formable(self) -> bool:
        return not self.waiting_for


def answering(pods: Sequence[PodView], statuses: Mapping[str, AgentStatus]) -> frozenset[str]:
    """The pods whose agents answered, less those whose engine container is not ready
    for lack of health (`PodView.engine_unready` with an unhealthy engine): one only
    behind takes part, since a round or a recovery is what brings it current."""
    unready = {p.name for p in pods if p.engine_unready}
    return frozenset(
        name
        for name, status in statuses.items()
        if name not in unready or (status.engine is not None and status.engine.healthy)
    )


def desired_members(
    spec: WeightSyncSpec,
    pods: Sequence[PodView],
    answering: Collection[str],
    previous: Sequence[Slot],
    *,
    sources: Sequence[int] | None = None,
    excluded: Collection[str] = (),
    previous_engine: str | None = None,
    unknown: Collection[str] = (),
) -> Desired:
    """The next generation's members: the trainer's source ranks (`sources`, by default
    the listed ones; in rank order: plan ranks 0..n-1, the lowest hosting the
    rendezvous), then every joinable sink.

    `answering` names the pods whose agents answered `GET /v1/status` at their latest
    poll; `unknown` those whose latest polls only timed out, lately: a member of the
    planned group among them keeps its place (a slow answer is no evidence that it
    left; dropping it would re-form the whole group), a newcomer waits for an answer.
    `excluded` names pods held out for a while (a failed plan delivery or a member that
    did not warm in time). Colocated groups have only the source members (one pod's),
    and the engine the lead hands off to: the one planned before (`previous_engine`)
    while joinable.
    """
    planned = {slot.pod for slot in previous}

    def eligible(pod: PodView) -> bool:
        heard = pod.name in answering or (pod.name in unknown and pod.name in planned)
        return pod.joinable and heard and pod.name not in excluded

    by_rank = {p.rank: p for p in pods if p.role is Role.SOURCE}
    members = []
    for rank in sorted(spec.trainer.listed_ranks() if sources is None else sources):
        pod = by_rank.get(rank)
        if pod is None or not eligible(pod):
            return Desired((), waiting_for=f"the source agent of trainer rank {rank}")
        members.append(pod)
    if not members:
        return Desired((), waiting_for="a trainer pod (sourceRanks: [all])")
    sinks = [p for p in pods if p.role is Role.SINK and eligible(p)]
    if spec.mode is SyncMode.COLOCATED:
        return _colocated(members, sinks, previous_engine)
    if not sinks:
        return Desired((), waiting_for="a ready inference pod whose agent answers")
    order = {slot.pod: slot.rank for slot in previous}
    continuing = sorted((p for p in sinks if p.name in order), key=lambda p: order[p.name])
    newcomers = sorted(
        (p for p in sinks if p.name not in order), key=lambda p: (p.inference_index or 0, p.name)
    )
    return Desired((*members, *continuing, *newcomers))


def _colocated(
    sources: Sequence[PodView], engines: Sequence[PodView], previous_engine: str | None
) -> Desired:
    """The source ranks, all on one node, and the engine on that node they hand off to."""
    node = sources[0].node
    apart = sorted({p.name for p in sources if p.node != node})
    if apart:  # [all] over a trainer of several pods: one engine cannot span nodes
        return Desired(
            (),
            waiting_for=f"every Colocated source rank on node {node} (the engine's), not on"
            f" {', '.join(apart)}: run one trainer pod",
        )
    local = [p for p in engines if p.node is not None and p.node == node]
    local.sort(key=lambda p: (p.name != previous_engine, p.inference_index or 0, p.name))
    if not local:
        return Desired((), waiting_for=f"a ready inference pod on node {node}")
    return Desired(tuple(sources), engine=local[0])


def slots(members: Sequence[PodView]) -> tuple[Slot, ...]:
    return tuple(Slot(rank, pod.name, pod.role) for rank, pod in enumerate(members))


def rank_state(
    status: AgentStatus | None, generation: int | None, rank: int
) -> GenerationState | None:
    """The state an agent reports for `generation` at `rank`; None when it lists no such
    generation at that rank (or does not answer). Every "warm at g, rank r" reads this."""
    if status is None or generation is None:
        return None
    for held in status.generations:  # a loop, not next(genexpr): 1,000 members, many calls
        if held.generation == generation and held.rank == rank:
            return held.state
    return None


def holds(status: AgentStatus | None, generation: int, rank: int) -> bool:
    """Whether an agent holds `generation` at `rank` in a state that can still serve."""
    return rank_state(status, generation, rank) in HOLDING_STATES


def warm_at(status: AgentStatus | None, generation: int | None, rank: int) -> bool:
    """Whether an agent has pre-warmed (or runs rounds in) `generation` at `rank`."""
    return rank_state(status, generation, rank) in WARM_STATES


def needs_new_generation(
    desired: Desired,
    planned: Sequence[Slot],
    planned_generation: int | None,
    statuses: Mapping[str, AgentStatus],
    *,
    planned_from_older_spec: bool = False,
    planned_engine: str | None = None,
    abandoned: bool = False,
    batching: bool = False,
) -> bool:
    """Whether the planned generation no longer describes the group the operator wants.

    `statuses`: the answers given since the planned generation was delivered; a member
    with none is unknown, not cold, and no reason for a new generation (only a member
    that answered without holding it is). `planned_from_older_spec`: the spec changed
    since the group was planned (transfer options, timeouts), and agents only learn
    those from a new plan. `planned_engine`: the Colocated engine pod the planned
    generation hands off to. `abandoned`: the planned generation passed its pre-warm
    timeout with cold members; once a group is formable again (their sit-out over), it
    is planned anew, even with the same members: a retry, not a wait on a dead one.
    `batching`: more inference pods are on their way and the newcomers have waited
    less than `JOIN_BATCH_SECONDS` (`newcomers_wait`): newcomers alone wait for them.
    """
    if not desired.formable:
        return False
    if planned_generation is None or planned_from_older_spec or abandoned:
        return True
    if desired.engine_pod != planned_engine:
        return True
    if not intact(planned, planned_generation, statuses):
        return True
    if not leads(planned, desired.members):
        return True
    # Only newcomers: they wait while the planned generation still forms, so that a
    # scale-up forms a few generations, not one per pass (each is a new communicator
    # for every member). They join the next one, planned once this one is warm.
    newcomers = len(desired.members) > len(planned)
    return newcomers and not (batching or forming(planned, planned_generation, statuses))


def leads(planned: Sequence[Slot], members: Sequence[PodView]) -> bool:
    """Whether `members` begin with the `planned` slots, rank for rank (compared in place:
    every pass asks, and building a thousand slots to compare was a tenth of a pass)."""
    if len(members) < len(planned):
        return False
    for rank, (slot, pod) in enumerate(zip(planned, members[: len(planned)], strict=True)):
        if slot.rank != rank or slot.pod != pod.name or slot.role is not pod.role:
            return False
    return True


def newcomers_wait(
    pods: Sequence[PodView],
    desired: Desired,
    planned: Sequence[Slot],
    *,
    cooling: Collection[str],
    waiting_for: float,
    replicas: int,
) -> bool:
    """Whether newcomers should wait for more: an inference pod outside the planned group
    and the desired one is on its way (live, not sitting out: `cooling`), or not even
    created yet (the Deployments ask for `replicas`, more than the live ones), and the
    newcomers have waited `waiting_for` seconds, less than `JOIN_BATCH_SECONDS`."""
    if waiting_for >= JOIN_BATCH_SECONDS:
        return False
    live = [p for p in pods if p.role is Role.SINK and p.live]
    if len(live) < replicas:
        return True
    known = {slot.pod for slot in planned} | {m.name for m in desired.members}
    return any(p.name not in known and p.name not in cooling for p in live)


def forming(planned: Sequence[Slot], generation: int, statuses: Mapping[str, AgentStatus]) -> bool:
    """Whether a member that answered (`statuses`) still forms `generation`, and no source
    reports it warm: a source warms only once the pre-warm barrier has passed on every
    member, so the others' own answers (polled before that) are older news."""
    if any(
        slot.role is Role.SOURCE and warm_at(statuses.get(slot.pod), generation, slot.rank)
        for slot in planned
    ):
        return False
    return any(
        rank_state(statuses[slot.pod], generation, slot.rank) is GenerationState.FORMING
        for slot in planned
        if slot.pod in statuses
    )


def intact(
    planned: Sequence[Slot], generation: int | None, statuses: Mapping[str, AgentStatus]
) -> bool:
    """Whether no member that answered (`statuses`) reports `generation` gone from it
    (never received, broken, retired at its rank): the evidence a generation needs
    before it is given up."""
    if generation is None:
        return False
    return all(
        holds(statuses[slot.pod], generation, slot.rank) for slot in planned if slot.pod in statuses
    )


def cold_members(
    planned: Sequence[Slot], generation: int, statuses: Mapping[str, AgentStatus]
) -> list[Slot]:
    """Members that took `generation`'s plan and did not warm it (their agent lists it at
    their rank, not warm or active). One that does not list it never got the plan (a
    replaced pod, a restarted agent): it needs a new plan, not a cooldown. One that does
    not answer is unknown, not cold."""
    cold = []
    for slot in planned:
        status = statuses.get(slot.pod)
        if status is None:
            continue
        listed = any(g.generation == generation for g in status.generations)
        if listed and not warm_at(status, generation, slot.rank):
            cold.append(slot)
    return cold


def next_generation(planned_generation: int | None, statuses: Mapping[str, AgentStatus]) -> int:
    """One more than any generation the operator or an agent has seen."""
    seen = [planned_generation or 0]
    seen.extend(g.generation for status in statuses.values() for g in status.generations)
    return max(seen) + 1


def backend_for(members: Sequence[PodView]) -> Backend:
    """NCCL when every member's agent holds its buckets on a GPU, gloo otherwise."""
    on_gpu = all(p.device.startswith("cuda") for p in members)
    return Backend.NCCL if on_gpu else Backend.GLOO


def holder_ranks(spec: WeightSyncSpec, world_size: int, sources: int = 1) -> frozenset[int]:
    """The ranks asked to hold: rank 0 (the lead source) and the `holders - 1` lowest sink
    ranks (sinks follow the `sources` source ranks; every rank assembles whole versions);
    none with recovery off. Colocated: the source alone, which reloads its engine from
    the held copy when it restarts (`agent.local_reload`)."""
    if world_size < 1 or not spec.recovery.enabled:
        return frozenset()
    if spec.mode is SyncMode.COLOCATED:
        return frozenset({0})
    sinks = range(sources, min(sources + spec.recovery.holders - 1, world_size))
    return frozenset({0, *sinks})


def build_plans(
    *,
    sync_name: str,
    spec: WeightSyncSpec,
    generation: int,
    members: Sequence[PodView],
    rendezvous_port: int,
    engine: PodView | None = None,
) -> list[MembershipPlan]:
    """One `MembershipPlan` per member (each addressed to its own rank); `engine`: the
    Colocated inference pod the source hands off to. Source ranks get the roster; sinks
    a compact plan with their own entry (`MembershipPlan`: O(members) bytes in all)."""
    hosts = [p.ip for p in members]
    if any(host is None for host in hosts):
        raise ValueError("every member of a plan needs a pod IP")
    plan_members = [
        PlanMember(rank=rank, pod=pod.name, host=pod.ip or "", role=pod.role)
        for rank, pod in enumerate(members)
    ]
    transfer = TransferOptions(
        bucket_size_bytes=spec.transfer.bucket_size_bytes,
        pipeline_depth=spec.transfer.pipeline_depth,
        timeout_seconds=float(spec.transfer.timeout_seconds),
        checksum=spec.transfer.checksum,
    )
    sources = sum(p.role is Role.SOURCE for p in members)
    holding = holder_ranks(spec, len(members), sources)
    backend = backend_for(members)
    rendezvous = Rendezvous(host=members[0].ip or "", port=rendezvous_port)
    handoff = local_engine(spec, engine) if engine is not None else None
    return [
        MembershipPlan(
            sync_name=sync_name,
            generation=generation,
            rank=member.rank,
            backend=backend,
            mode=spec.mode,
            rendezvous=rendezvous,
            members=plan_members if member.role is Role.SOURCE else [member],
            world_size=len(members),
            source_count=sources,
            transfer=transfer,
            prewarm_timeout_seconds=float(spec.prewarm.timeout_seconds),
            holder=member.rank in holding,
            local_engine=handoff,
        )
        for member in plan_members
    ]
