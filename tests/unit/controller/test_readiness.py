"""The weights-current gate: True only while the engine serves the current version."""

from __future__ import annotations

import pytest

from tests.unit.controller.builders import agent, pod, round_report, sink_view
from weightsync.api import reasons
from weightsync.api.control import AgentStatus, GenerationState
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names
from weightsync.controller.membership.workloads import pod_view
from weightsync.controller.readiness.gates import (
    Current,
    current_version,
    decide,
    gate_changes,
    round_vouches,
    rounds_reach,
)

W, A, F = GenerationState.WARM, GenerationState.ACTIVE, GenerationState.FORMING


@pytest.mark.parametrize(
    ("status", "version", "expected"),
    [
        (agent("e", engine_version=5), 5, (True, reasons.SERVES_CURRENT_VERSION)),
        (agent("e", engine_version=4), 5, (False, reasons.BEHIND_CURRENT_VERSION)),
        (agent("e", engine_version=None), 5, (False, reasons.BEHIND_CURRENT_VERSION)),
        (agent("e", engine_version=None), None, (False, reasons.NO_VERSION_YET)),
        (agent("e", engine_version=5, torn=True), 5, (False, reasons.ENGINE_TORN)),
        (None, 5, (False, reasons.AGENT_UNREACHABLE)),
    ],
)
def test_gate_decisions(
    status: AgentStatus | None, version: int | None, expected: tuple[bool, str]
) -> None:
    decision = decide(sink_view("e"), status, "connection refused", Current(version))
    assert (decision.status, decision.reason) == expected


def test_a_pod_with_a_container_not_ready_is_held_whatever_its_agent_said() -> None:
    # A container restarting in place: the agent's last word predates the restart.
    view = sink_view("e", containers_ready=False)
    decision = decide(view, agent("e", engine_version=5), None, Current(5))
    assert (decision.status, decision.reason) == (False, reasons.CONTAINERS_NOT_READY)


def test_a_load_older_than_the_engine_containers_start_opens_no_gate() -> None:
    """The agent polls its engine once a second: restarted twice between two polls, the
    engine's container starts after the load the agent still vouches for. The kubelet's
    start is to the second, so a load in that same second is not trusted either."""
    raw = pod("e").owned_by("ReplicaSet", "engine-a-abc").running("10.0.1.1")
    raw = raw.injected(gate=True).set(
        "status.containerStatuses",
        [
            {"name": "engine", "state": {"running": {"startedAt": "2026-11-28T02:00:10Z"}}},
            {"name": names.AGENT_CONTAINER,
             "state": {"running": {"startedAt": "2026-11-28T02:00:30Z"}}},
        ],
    )  # fmt: skip
    view = pod_view(raw.build(), Role.SINK, "engine-a", 0, None)
    assert view.workload_started is not None  # the engine's, not the agent's later one
    started = view.workload_started.timestamp()

    def loaded(at: float) -> AgentStatus:
        status = agent("e", engine_version=5)
        assert status.engine is not None
        return status.model_copy(
            update={"engine": status.engine.model_copy(update={"loaded_unix": at})}
        )

    for at, expected in [
        (started - 5.0, (False, reasons.BEHIND_CURRENT_VERSION)),  # into the last process
        (started + 0.5, (False, reasons.BEHIND_CURRENT_VERSION)),  # the same second
        (started + 1.0, (True, reasons.SERVES_CURRENT_VERSION)),
    ]:
        decision = decide(view, loaded(at), None, Current(5))
        assert (decision.status, decision.reason) == expected, at
    assert (
        "started after its agent last loaded it"
        in decide(view, loaded(started - 5.0), None, Current(5)).message
    )
    # No load time (an older agent) or no running start: the agent's word decides alone.
    assert decide(view, agent("e", engine_version=5), None, Current(5)).status


def test_unreachable_names_the_error() -> None:
    decision = decide(sink_view("e"), None, "ClientConnectorError: refused", Current(3))
    assert "ClientConnectorError: refused" in decision.message


def test_current_version_follows_the_source_and_survives_its_restart() -> None:
    stored = Current(5, "L1")
    source = agent("t", Role.SOURCE, version=7, lineage="L1")
    assert current_version(source, stored) == Current(7, "L1")
    restarted = agent("t", Role.SOURCE, version=None)
    assert current_version(restarted, stored) == stored  # a restarted trainer's agent
    assert current_version(None, Current(None)) == Current(None)


def test_a_new_lineage_is_current_even_at_a_lower_version_and_the_old_one_is_behind() -> None:
    """A trainer restarted from step 3 publishes a new lineage: engines still serving
    step 5 of the old one do not serve the current weights."""
    current = current_version(agent("t", Role.SOURCE, version=3, lineage="L2"), Current(5, "L1"))
    assert current == Current(3, "L2")
    old = decide(sink_view("e"), agent("e", engine_version=3, lineage="L1"), None, current)
    assert (old.status, old.reason) == (False, reasons.BEHIND_CURRENT_VERSION)
    assert "another lineage" in old.message
    new = decide(sink_view("e"), agent("e", engine_version=3, lineage="L2"), None, current)
    assert new.status


def test_only_gated_live_pods_whose_condition_differs_are_changed() -> None:
    def view(name: str, *, gate: bool = True, condition: tuple[str, str] | None = None,
             terminating: bool = False, running: bool = True) -> object:  # fmt: skip
        builder = pod(name).owned_by("ReplicaSet", "rs").injected(gate=gate)
        if running:
            builder.running()
        if condition:
            builder.gate(*condition)
        if terminating:
            builder.set("metadata.deletionTimestamp", "2026-01-01T00:00:00Z")
        return pod_view(builder.build(), Role.SINK, "engine-a", 0, None)

    pods = [
        view("current", condition=("True", reasons.SERVES_CURRENT_VERSION)),
        view("behind", condition=("True", reasons.SERVES_CURRENT_VERSION)),
        view("new"),
        view("ungated", gate=False),
        view("leaving", terminating=True),
        # Not started, no condition: a missing gate already counts False, nothing to write.
        view("pending", running=False),
        # Not running but carrying True (stopped, or its node lost): closed.
        view("stopped", running=False, condition=("True", reasons.SERVES_CURRENT_VERSION)),
    ]
    statuses = {p: agent(p, engine_version=5) for p in ("current", "ungated", "leaving")}
    statuses["behind"] = agent("behind", engine_version=4)
    statuses["new"] = agent("new", engine_version=None)
    changes = gate_changes(pods, statuses, {}, Current(5))  # type: ignore[arg-type]
    assert [(c.pod, c.status) for c in changes] == [
        ("behind", False),
        ("new", False),
        ("stopped", False),
    ]


def test_a_pod_the_next_round_would_miss_is_held_until_its_generation_is_warm() -> None:
    """A recovered pod serves the current version but only joined generation 3, which the
    source has not warmed: the next round runs in generation 2 and would leave it behind."""
    recovered = agent("e-new", generations={3: (W, 2)}, engine_version=6)
    member = agent("e-1", generations={2: (A, 1), 3: (W, 1)}, engine_version=6)
    source = agent("trainer-0", Role.SOURCE, generations={2: (A, 0), 3: (F, 0)}, version=6)
    statuses = {"trainer-0": source, "e-1": member, "e-new": recovered}
    reached = rounds_reach(source, statuses)
    assert reached == {"trainer-0", "e-1"}
    held = decide(sink_view("e-new"), recovered, None, Current(6), reached=reached)
    assert (held.status, held.reason) == (False, reasons.NOT_IN_ROUNDS)
    kept = decide(sink_view("e-1"), member, None, Current(6), reached=reached)
    assert (kept.status, kept.reason) == (True, reasons.SERVES_CURRENT_VERSION)

    # Generation 3 warm on the source: its next round reaches the recovered pod, and a
    # member whose last answer (older than the source's) still said forming: the source
    # warms only after the pre-warm ran on every member. One that does not hold 3 is missed.
    source = agent("trainer-0", Role.SOURCE, generations={2: (A, 0), 3: (W, 0)}, version=6)
    late = agent("e-2", generations={2: (A, 2), 3: (F, 3)}, engine_version=6)
    left = agent("e-3", generations={2: (A, 3), 3: (GenerationState.BROKEN, 4)}, engine_version=6)
    everyone = statuses | {"trainer-0": source, "e-2": late, "e-3": left}
    assert rounds_reach(source, everyone) == {"trainer-0", "e-1", "e-new", "e-2"}
    # A member of generation 3 whose last answer predates its delivery holds it too (the
    # source warmed it with every member); one that answered since without it does not
    # (it refused the plan, or its agent restarted), nor does a pod the plan left out.
    # Generation 4, planned since, is no reason to miss e-4 in a round in generation 3.
    unheard = agent("e-4", generations={2: (A, 4)}, engine_version=6)
    refused = agent("e-5", generations={2: (A, 5)}, engine_version=6)
    outside = agent("e-6", generations={2: (A, 6)}, engine_version=6)
    later = everyone | {"e-4": unheard, "e-5": refused, "e-6": outside}
    delivered = {3: frozenset({"e-4"}), 4: frozenset({"e-4", "e-6"})}
    reached = rounds_reach(source, later, delivered)
    assert reached == {"trainer-0", "e-1", "e-new", "e-2", "e-4"}
    assert "e-4" not in (rounds_reach(source, later) or ())
    # ...unless a round is still running in generation 2: it misses the pod.
    busy = agent(
        "trainer-0", Role.SOURCE, generations={2: (A, 0), 3: (W, 0)}, version=6,
        round_in_progress=True,
    )  # fmt: skip
    assert "e-new" not in (rounds_reach(busy, statuses | {"trainer-0": busy}) or ())
    # No word from the source, or no generation it could run a round in (the last one
    # broke, none forming yet): the served version alone decides, as before.
    assert rounds_reach(None, statuses) is None
    broken = agent("trainer-0", Role.SOURCE, generations={2: (GenerationState.BROKEN, 0)})
    assert rounds_reach(broken, statuses) is None
    assert decide(sink_view("e-new"), recovered, None, Current(6), reached=None).status
    # None warm, one forming (the first group, or the next after a break): the next round
    # runs in a generation yet to warm. A pod recovered before it was planned into any
    # is missed by it; a pod holding one is left to its served version.
    first = agent("trainer-0", Role.SOURCE, generations={1: (F, 0)}, version=6)
    forming = agent("e-1", generations={1: (F, 1)}, engine_version=6)
    alone = agent("e-new", engine_version=6)
    reached = rounds_reach(first, {"trainer-0": first, "e-1": forming, "e-new": alone})
    assert reached == {"trainer-0", "e-1"}
    missed = decide(sink_view("e-new"), alone, None, Current(6), reached=reached)
    assert (missed.status, missed.reason) == (False, reasons.NOT_IN_ROUNDS)
    # The same when the source's last answer predates the plan (it names no generation
    # yet): the generation was delivered to it, so it forms one.
    before = agent("trainer-0", Role.SOURCE, version=6)
    asked = {"trainer-0": before, "e-1": forming, "e-new": alone}
    assert rounds_reach(before, asked) is None
    assert rounds_reach(before, asked, {1: frozenset({"trainer-0"})}) == {"trainer-0", "e-1"}


def test_while_the_source_is_unheard_open_gates_stay_open_and_closed_ones_closed() -> None:
    """The planned source's poll failed: which generation the next round runs in is
    unknown, so a recovered sink's own word opens nothing (it opened, then closed again
    once the source was heard); a gate already open is no reason to close."""
    recovered = agent("e-new", engine_version=6)
    closed = sink_view("e-new", gate_status="False")
    held = decide(closed, recovered, None, Current(6), source_unheard=True)
    assert (held.status, held.reason) == (False, reasons.SOURCE_UNHEARD)
    opened = sink_view("e-1", gate_status="True")
    kept = decide(opened, agent("e-1", engine_version=6), None, Current(6), source_unheard=True)
    assert (kept.status, kept.reason) == (True, reasons.SERVES_CURRENT_VERSION)
    behind = decide(opened, agent("e-1", engine_version=5), None, Current(6), source_unheard=True)
    assert (behind.status, behind.reason) == (False, reasons.BEHIND_CURRENT_VERSION)
    assert decide(closed, recovered, None, Current(6)).status  # heard, no round to miss


def test_a_sweep_straddling_a_round_closes_no_gate_of_the_rounds_members() -> None:
    """The sweep asked e-1 and e-2 before the source's round in generation 2 committed
    version 6 and the source after it (one poll: one asked time). An ok round committed on
    every member, so their older answers (version 5) close no open gate; their next answer,
    asked after the source's first word of 6, decides."""
    report = round_report(6).model_copy(update={"generation": 2})
    source = agent("trainer-0", Role.SOURCE, generations={2: (A, 0)}, version=6, last_round=report)
    member = agent("e-1", generations={2: (A, 1)}, engine_version=5)
    closed = agent("e-2", generations={2: (A, 2)}, engine_version=5)
    outside = agent("e-3", generations={1: (A, 1)}, engine_version=5)  # not in generation 2
    restarted = agent("e-4", generations={2: (A, 3)}, engine_version=None)  # engine restarted
    statuses = {"trainer-0": source, "e-1": member, "e-2": closed, "e-3": outside, "e-4": restarted}
    same_sweep = dict.fromkeys(statuses, 10.0)
    vouched = round_vouches(source, Current(6), statuses, same_sweep, source_since=10.0)
    assert vouched == {"e-1", "e-2"}
    pods = [
        sink_view("e-1", gate_status="True", gate_reason=reasons.SERVES_CURRENT_VERSION),
        sink_view("e-2"),  # closed already: nothing but its own word opens it
        sink_view("e-3", gate_status="True", gate_reason=reasons.SERVES_CURRENT_VERSION),
        sink_view("e-4", gate_status="True", gate_reason=reasons.SERVES_CURRENT_VERSION),
    ]
    changes = gate_changes(pods, statuses, {}, Current(6), vouched=vouched)
    assert [(c.pod, c.status, c.reason) for c in changes] == [
        ("e-2", False, reasons.BEHIND_CURRENT_VERSION),
        ("e-3", False, reasons.BEHIND_CURRENT_VERSION),
        ("e-4", False, reasons.BEHIND_CURRENT_VERSION),
    ]
    # Asked after the source's first word of 6 and still on 5: behind, gate closed.
    later = {**same_sweep, "e-1": 15.0}
    assert round_vouches(source, Current(6), statuses, later, source_since=10.0) == {"e-2"}
    # No vouching for a failed round, a round of another version or lineage, or none.
    failed = source.model_copy(update={"last_round": report.model_copy(update={"ok": False})})
    older = source.model_copy(update={"last_round": report.model_copy(update={"version": 5})})
    other = source.model_copy(update={"last_round": report.model_copy(update={"lineage": "L2"})})
    for word in (failed, older, None):
        assert round_vouches(word, Current(6), statuses, same_sweep, source_since=10.0) == set()
    assert round_vouches(other, Current(6, "L1"), statuses, same_sweep, 10.0) == set()
    assert round_vouches(source, Current(6), statuses, same_sweep, source_since=None) == set()


def test_an_engine_ahead_of_the_sources_word_keeps_its_gate_open() -> None:
    """The source commits a round last: a poll that heard the members after the round and
    the source before it saw them serve the next version. Not behind: an open gate stays
    open, a closed one waits for the source's word; another lineage is no later version."""
    opened = sink_view("e-1", gate_status="True")
    closed = sink_view("e-1", gate_status="False")
    later = agent("e-1", engine_version=7, lineage="L1")
    kept = decide(opened, later, None, Current(6, "L1"))
    assert (kept.status, kept.reason) == (True, reasons.SERVES_CURRENT_VERSION)
    assert not decide(closed, later, None, Current(6, "L1")).status
    other = agent("e-1", engine_version=7, lineage="L0")  # a trainer restarted from step 6
    assert not decide(opened, other, None, Current(6, "L1")).status
    assert not decide(opened, later, None, Current(None)).status
    # The next round's reach still applies to it.
    missed = decide(opened, later, None, Current(6, "L1"), reached=frozenset())
    assert (missed.status, missed.reason) == (False, reasons.NOT_IN_ROUNDS)
