"""Which protocol a pull uses and from which holders, and the RecoveryProtocol condition."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from tests.unit.controller.builders import agent, sink_view, source_view, sync
from weightsync.api import reasons
from weightsync.api.conditions import ConditionUpdate, set_conditions
from weightsync.api.control import AgentStatus, RecoveryTransport
from weightsync.api.v1alpha1 import RecoveryProtocol, Role, WeightSyncStatus
from weightsync.controller.readiness.gates import Current
from weightsync.controller.recovery.decisions import Step, plan_recoveries
from weightsync.controller.recovery.pull_protocol import (
    member_transport,
    protocol_condition,
    pull_over,
)
from weightsync.controller.status.transitions import transition_events

AUTO, RDMA, TCP = RecoveryProtocol.AUTO, RecoveryProtocol.RDMA, RecoveryProtocol.TCP
ON_RDMA = RecoveryTransport(protocol=RDMA, usable=True, detail="Auto: RDMA on mlx5_0")
ON_TCP = RecoveryTransport(protocol=TCP, usable=True, detail="Auto: TCP, since no RDMA device")
BROKEN = RecoveryTransport(protocol=RDMA, usable=False, detail="RDMA requested, but no device")
PORT = 8470


def reporting(status: AgentStatus, transport: RecoveryTransport | None) -> AgentStatus:
    return status.model_copy(update={"recovery_transport": transport})


@pytest.mark.parametrize(
    ("puller", "served", "expected"),
    [
        (ON_RDMA, {"a": ON_RDMA, "b": ON_TCP}, (RDMA, ("a",))),
        # A puller on RDMA reads TCP holders too: TCP needs only the transfer engine.
        (ON_RDMA, {"a": ON_TCP, "b": ON_TCP}, (TCP, ("a", "b"))),
        # A puller on TCP cannot read an RDMA holder.
        (ON_TCP, {"a": ON_RDMA, "b": ON_TCP}, (TCP, ("b",))),
        (ON_TCP, {"a": ON_RDMA}, None),
        # Holders that cannot serve, or never reported, are not read; nor can a broken puller.
        (ON_RDMA, {"a": BROKEN}, None),
        (ON_RDMA, {}, None),
        (BROKEN, {"a": ON_RDMA}, None),
    ],
)
def test_pull_over(
    puller: RecoveryTransport,
    served: dict[str, RecoveryTransport],
    expected: tuple[RecoveryProtocol, tuple[str, ...]] | None,
) -> None:
    assert pull_over(puller, ["a", "b"], served) == expected


@pytest.mark.parametrize(("requested", "assumed"), [(AUTO, TCP), (TCP, TCP), (RDMA, RDMA)])
def test_an_agent_that_does_not_report_uses_its_environment(
    requested: RecoveryProtocol, assumed: RecoveryProtocol
) -> None:
    # The webhook writes no protocol under Auto, and such an agent's default is TCP.
    transport = member_transport(agent("old"), requested)
    assert (transport.protocol, transport.usable) == (assumed, True)
    assert member_transport(reporting(agent("new"), ON_RDMA), requested) == ON_RDMA


def condition(transports: dict[str, RecoveryTransport | None], **spec: Any) -> Any:
    paths = {f"spec__{key}": value for key, value in spec.items()}
    statuses = {pod: reporting(agent(pod), t) for pod, t in transports.items()}
    return protocol_condition(sync(**paths).spec, statuses)


@pytest.mark.parametrize(
    ("transports", "spec", "status", "reason", "says"),
    [
        ({"a": ON_RDMA, "b": ON_RDMA}, {}, "True", reasons.USING_RDMA, "RDMA on all 2 agents"),
        ({"a": ON_TCP, "b": ON_TCP}, {}, "True", reasons.USING_TCP, "since no RDMA device"),
        ({"a": None}, {}, "True", reasons.USING_TCP, "a: assumed"),
        ({"a": ON_RDMA, "b": ON_TCP, "c": ON_TCP}, {}, "False", reasons.PROTOCOLS_DIFFER,
         "RDMA on a; TCP on b, c"),
        ({"a": ON_RDMA, "b": BROKEN}, {"recovery": {"protocol": "RDMA"}}, "False",
         reasons.PROTOCOL_UNAVAILABLE, "cannot work on b, which neither hold nor pull (b: RDMA"),
        ({}, {}, "Unknown", reasons.PROTOCOL_NOT_REPORTED, "No agent"),
        ({"a": ON_RDMA}, {"recovery": {"enabled": False}}, "False", reasons.RECOVERY_OFF,
         "spec.recovery.enabled is false"),
        ({"a": ON_RDMA}, {"mode": "Colocated"}, "False", reasons.RECOVERY_OFF, "Colocated"),
    ],
)  # fmt: skip
def test_the_condition(
    transports: dict[str, RecoveryTransport | None],
    spec: dict[str, Any],
    status: str,
    reason: str,
    says: str,
) -> None:
    update = condition(transports, **spec)
    assert (update.type, update.status.value, update.reason) == ("RecoveryProtocol", status, reason)
    assert says in update.message


def test_a_mixed_group_pulls_what_each_pod_can_read() -> None:
    """The source is on RDMA; one sink holds over TCP; a pod on TCP pulls from that sink
    only, a pod on RDMA from the source, and a pod on TCP with only RDMA holders waits."""
    source, old, new = (
        source_view(),
        sink_view("e-old", ip="10.0.1.1"),
        sink_view("e-new", ip="10.0.1.2"),
    )
    spec = sync(spec__recovery={"holders": 2}).spec
    source_url, old_url = "http://10.0.0.1:8470", "http://10.0.1.1:8470"

    def decide(new_transport: RecoveryTransport, old_holds: int | None) -> Any:
        statuses = {
            source.name: reporting(agent(source.name, Role.SOURCE, version=5, holding=5), ON_RDMA),
            old.name: reporting(agent(old.name, engine_version=5, holding=old_holds), ON_TCP),
            new.name: reporting(agent(new.name), new_transport),
        }
        (decision,) = plan_recoveries(
            spec, Current(5), pods=[source, old, new], statuses=statuses, trackers={},
            now=0.0, default_port=PORT,
        )  # fmt: skip
        return decision

    on_tcp = decide(ON_TCP, old_holds=5)
    assert (on_tcp.step, on_tcp.protocol, on_tcp.holders) == (Step.START, TCP, (old_url,))
    on_rdma = decide(ON_RDMA, old_holds=5)
    assert (on_rdma.step, on_rdma.protocol, on_rdma.holders) == (Step.START, RDMA, (source_url,))
    stranded = decide(ON_TCP, old_holds=None)
    assert stranded.step is Step.ADMIT  # nothing it can read: the next round brings it


def test_pulls_that_cannot_work_are_a_warning_once() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)

    def status_with(update: ConditionUpdate) -> WeightSyncStatus:
        conditions = set_conditions([], [update], observed_generation=1, now=now)
        return WeightSyncStatus(conditions=conditions)

    fine = status_with(condition({"a": ON_TCP}))
    mixed = status_with(condition({"a": ON_RDMA, "b": ON_TCP}))
    [event] = transition_events(fine, mixed)
    assert (event.type, event.reason) == ("Warning", reasons.PROTOCOLS_DIFFER)
    assert transition_events(mixed, mixed) == []
    [back] = transition_events(mixed, fine)
    assert (back.type, back.reason) == ("Normal", reasons.USING_TCP)
