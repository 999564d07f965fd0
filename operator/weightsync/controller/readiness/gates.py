"""The `weightsync.io/weights-current` readiness gate: which inference pods may serve. Pure.

A pod's gate is True only while its engine serves the WeightSync's current version:
the version the trainer's source agent last published successfully (a round only
succeeds when every member committed it). Before the first version the gate is False:
engines start from placeholder weights (`--load-format dummy`), which must not serve.
A pod whose agent does not answer is held False too: the operator cannot vouch for it.
An engine restarted in place is behind whatever it reports: its agent vouches only for
what it loaded into that engine process (`agent.engine_watch`). And the gate closes as
soon as the pod's containers are not ready (a container restarting), without waiting
for the agent to notice: the restarted engine must not turn the pod Ready on an
earlier pass's word. It opens again only on the agent's word of a load after the
container's start (`loaded_before_start`): the agent polls its engine once a second,
and a second restart between two polls left it vouching for a process that was gone.

A pod that serves the current version but that the trainer's next round would not
reach (a recovered pod whose generation is not warm yet on the source: the next round
runs in the older one) stays False too: it would be behind the moment that round ends,
for as long as the next pass takes to notice (`rounds_reach`). Once the source reports
that generation warm, every member holding it is reached, whatever its own last answer
said (it may predate the pre-warm, or the plan, that the source's word proves done).

Polls are not simultaneous either: a sweep that straddles a round asks some sinks
before it commits and the source after, and took the older answers for sinks left
behind (656 of 1,000 gates closed at one steady round, open again at the next sweep).
An open gate stays open while the sink's last answer may predate the source's first
word of the current version, if it was a member of the generation that round ran in
(a round is ok only when every member committed): the sink's next answer decides
(`round_vouches`). Nothing opens a gate but the agent's own word.

While the planned source's poll fails (it timed out under load, or the trainer pod is
gone), which generation the next round runs in is unknown: open gates stay open, and no
closed one opens (`source_unheard`); a sink opened on its own word then closed again
when the source was heard (11 gates in one `make scale` run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weightsync.api import reasons
from weightsync.api.control import AgentStatus, GenerationState
from weightsync.api.v1alpha1 import Role
from weightsync.controller.membership.plan import WARM_STATES
from weightsync.controller.membership.workloads import PodView


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The weights-current condition one pod should carry."""

    pod: str
    status: bool
    reason: str
    message: str

    @property
    def status_text(self) -> str:
        return "True" if self.status else "False"


@dataclass(frozen=True, slots=True)
class Current:
    """The version every ready sink must serve, and the Publisher lineage it belongs to
    (a trainer restarted from an earlier step publishes a new lineage from lower numbers)."""

    version: int | None
    lineage: str | None = None


def current_version(source: AgentStatus | None, stored: Current) -> Current:
    """The source agent's last published version, or the stored one while it has none
    (a restarted trainer's agent starts empty; the sinks still serve what it sent)."""
    if source is not None and source.version is not None:
        return Current(source.version, source.lineage)
    return stored


def served_version(status: AgentStatus | None) -> int | None:
    """The version a sink's agent vouches its engine serves (None: behind, or unknown)."""
    if status is None:
        return None
    if status.engine is not None:
        return None if status.engine.torn else status.engine.version
    return status.version


def serves(status: AgentStatus | None, current: Current) -> bool:
    """Whether the pod's engine serves `current`: the version, of the same lineage (an
    engine loaded by a Colocated peer names no lineage: the version decides)."""
    if current.version is None or served_version(status) != current.version:
        return False
    lineage = status.engine.lineage if status is not None and status.engine else None
    return current.lineage is None or lineage is None or lineage == current.lineage


def ahead(status: AgentStatus | None, current: Current) -> bool:
    """Whether the pod's engine serves a later version of the current lineage than the
    source's last word: the source commits a round last, so its members serve the
    version before it says so, and a poll may hear a member after the round and the
    source before it (at make scale 988 open gates closed on that, for one sweep)."""
    served = served_version(status)
    lineage = status.engine.lineage if status is not None and status.engine else None
    return (
        served is not None
        and current.version is not None
        and served > current.version
        and lineage is not None
        and lineage == current.lineage
    )


def rounds_reach(
    source: AgentStatus | None,
    statuses: Mapping[str, AgentStatus],
    unheard: Mapping[int, frozenset[str]] | None = None,
) -> frozenset[str] | None:
    """The pods the source's next round reaches: warm at the generation it would run in
    (its newest warm one) and, while a round is in flight, at that round's generation too.
    None when no round can be reached or known (no word from the source, or no warm
    generation on it and none forming or delivered to it since it last answered): the
    served version alone decides. With none warm but one forming (or just delivered),
    the next round runs in a generation yet to warm, with its members:
    a pod in no generation at all (recovered before it was planned into one) is missed,
    the others are left to their served version. `unheard`: by generation this process
    delivered, its members whose answer here predates the delivery."""
    if source is None:
        return None
    warm = [g.generation for g in source.generations if g.state in WARM_STATES]

    # The source warms a generation only once its pre-warm collective has run on every
    # member: a member still reporting it forming answered before that (polls are not
    # simultaneous), and a planned member whose last answer predates the plan holds it
    # too. Counting only its own word closed every gate at each new generation until
    # the next sweep (a thousand closes, then a thousand opens, at a scale-up). An answer
    # given after the plan that does not list it (refused, or the agent restarted) does.
    def held(pod: str, status: AgentStatus) -> set[int]:
        own = {
            g.generation
            for g in status.generations
            if g.state in WARM_STATES or g.state is GenerationState.FORMING
        }
        return own | {g for g, pods in (unheard or {}).items() if pod in pods}

    if not warm:
        # One forming on the source, or delivered to it since its last answer here (a
        # source polled before the plan named no generation at all: 26 newcomers' gates
        # opened on that at make scale and closed again 0.5 s later).
        if not held(source.pod, source):
            return None
        return frozenset(pod for pod, status in statuses.items() if held(pod, status))
    needed = {max(warm)}
    if source.round_in_progress and source.generation is not None:
        needed.add(source.generation)
    # Each pod's own word first, without a set: every pass asks it of every pod.
    unheard_at = [
        (generation, (unheard or {}).get(generation, frozenset())) for generation in needed
    ]
    return frozenset(
        pod
        for pod, status in statuses.items()
        if all(_holds_at(status, g) or pod in missing for g, missing in unheard_at)
    )


def _holds_at(status: AgentStatus, generation: int) -> bool:
    """Whether the agent lists `generation` warm, active or forming."""
    for held in status.generations:
        if held.generation == generation and (
            held.state in WARM_STATES or held.state is GenerationState.FORMING
        ):
            return True
    return False


def round_vouches(
    source: AgentStatus | None,
    current: Current,
    statuses: Mapping[str, AgentStatus],
    asked: Mapping[str, float],
    source_since: float | None,
) -> frozenset[str]:
    """The sinks the source's last round vouches for, whatever their own last answer: it
    ran in a generation they are members of, committed `current` (ok: on every member),
    and their answer was asked no later than the source's first answer naming `current`
    (`source_since`; the answers of one poll share the time they were asked), so it may
    predate the round. Their engine must still be the one their agent loaded (a version,
    not torn): a restarted engine is behind whatever the round said."""
    report = source.last_round if source is not None else None
    if (
        report is None
        or not report.ok
        or report.generation is None
        or source_since is None
        or current.version is None
        or report.version != current.version
        or bool(report.lineage and current.lineage and report.lineage != current.lineage)
    ):
        return frozenset()
    return frozenset(
        pod
        for pod, status in statuses.items()
        if status.role is Role.SINK
        and asked.get(pod, float("inf")) <= source_since
        and served_version(status) is not None
        and any(
            g.generation == report.generation and g.state in WARM_STATES for g in status.generations
        )
    )


def loaded_before_start(pod: PodView, status: AgentStatus) -> bool:
    """Whether the agent's vouched load predates the start of the pod's running engine
    container: then it went into a process that is gone, whatever the agent has polled
    since (a second restart in place can come between two of its polls). The kubelet's
    start is to the second, so a load within that second is not trusted either: the
    next load is (an engine takes seconds to start, a load more)."""
    engine, started = status.engine, pod.workload_started
    if engine is None or engine.loaded_unix is None or started is None:
        return False
    return engine.loaded_unix < started.timestamp() + 1.0


def decide(  # noqa: PLR0911 - one return per reason, in the order they are checked
    pod: PodView,
    status: AgentStatus | None,
    error: str | None,
    current: Current,
    *,
    reached: frozenset[str] | None = None,
    vouched: frozenset[str] = frozenset(),
    source_unheard: bool = False,
) -> GateDecision:
    # An engine container whose readiness its agent answers turns ready once the agent
    # vouches for it; the gate opens after that, so it never flaps open and shut while
    # the probe catches up (`pod_actions.restarting_behind_open_gate`).
    if not pod.containers_ready or pod.engine_unready:
        return GateDecision(
            pod.name, False, reasons.CONTAINERS_NOT_READY, reasons.CONTAINERS_NOT_READY_MESSAGE
        )
    if status is None:
        return GateDecision(
            pod.name,
            False,
            reasons.AGENT_UNREACHABLE,
            reasons.AGENT_UNREACHABLE_MESSAGE.format(error=error or "no status"),
        )
    if status.engine is not None and status.engine.torn:
        return GateDecision(pod.name, False, reasons.ENGINE_TORN, reasons.ENGINE_TORN_MESSAGE)
    version = current.version
    if version is None:
        return GateDecision(pod.name, False, reasons.NO_VERSION_YET, reasons.NO_VERSION_YET_MESSAGE)
    if loaded_before_start(pod, status):
        return GateDecision(
            pod.name,
            False,
            reasons.BEHIND_CURRENT_VERSION,
            reasons.BEHIND_CURRENT_VERSION_MESSAGE.format(served="no version", version=version)
            + " (its container started after its agent last loaded it)",
        )
    # An open gate of a sink the last round vouches for stays open (`round_vouches`), and
    # of one ahead of the source's word (`ahead`).
    if serves(status, current) or (
        pod.gate_status == "True" and (pod.name in vouched or ahead(status, current))
    ):
        if reached is not None and pod.name not in reached:
            return GateDecision(
                pod.name, False, reasons.NOT_IN_ROUNDS, reasons.NOT_IN_ROUNDS_MESSAGE
            )
        if source_unheard and pod.gate_status != "True":
            return GateDecision(
                pod.name, False, reasons.SOURCE_UNHEARD, reasons.SOURCE_UNHEARD_MESSAGE
            )
        return GateDecision(
            pod.name,
            True,
            reasons.SERVES_CURRENT_VERSION,
            reasons.SERVES_CURRENT_VERSION_MESSAGE,
        )
    served = served_version(status)
    return GateDecision(
        pod.name,
        False,
        reasons.BEHIND_CURRENT_VERSION,
        reasons.BEHIND_CURRENT_VERSION_MESSAGE.format(
            served="no version" if served is None else f"version {served}", version=version
        )
        + _lineage_note(status, current),
    )


def _lineage_note(status: AgentStatus | None, current: Current) -> str:
    engine = status.engine if status is not None else None
    if engine is None or engine.version != current.version or engine.lineage is None:
        return ""
    return " (of another lineage: the trainer restarted from an earlier step)"


def gate_changes(
    pods: Sequence[PodView],
    statuses: Mapping[str, AgentStatus],
    errors: Mapping[str, str],
    current: Current,
    *,
    reached: frozenset[str] | None = None,
    vouched: frozenset[str] = frozenset(),
    source_unheard: bool = False,
) -> list[GateDecision]:
    """Decisions for gated, live pods whose condition differs from what they carry. A pod
    that has not run yet and carries no condition is left alone: a missing gate condition
    already counts False, and writing one to a thousand pending pods at a scale-up only
    adds API load (and, on KWOK, re-runs its stages). `source_unheard`: a source is
    planned and its last poll failed (see the module doc)."""
    changes = []
    for pod in pods:
        if not pod.has_gate or pod.terminating:
            continue
        if not pod.running and pod.gate_status is None:
            continue
        status = statuses.get(pod.name)
        decision = decide(
            pod, status, errors.get(pod.name), current,
            reached=reached, vouched=vouched, source_unheard=source_unheard,
        )  # fmt: skip
        if (pod.gate_status, pod.gate_reason) != (decision.status_text, decision.reason):
            changes.append(decision)
    return changes
