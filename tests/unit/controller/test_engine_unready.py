"""An inference pod whose engine container's readiness its agent answers
(`admission.engine_probe`): not ready while behind, yet planned and recovered, since a
round or a recovery is what makes it ready again."""

from __future__ import annotations

from typing import Any

from tests.unit.controller.builders import agent, pod
from weightsync.api import reasons
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names
from weightsync.controller.cluster.cache import slim_pod
from weightsync.controller.membership.plan import answering
from weightsync.controller.membership.workloads import pod_view
from weightsync.controller.readiness.gates import Current, decide

RUNNING = {"running": {"startedAt": "2026-11-28T02:00:10Z"}}


def engine_pod(
    *, engine_ready: bool, agent_ready: bool = True, running: bool = True, answered: bool = True
) -> dict[str, Any]:
    built = pod("e").owned_by("ReplicaSet", "engine-a-abc")
    built = built.running("10.0.1.1", ready=engine_ready and agent_ready)
    built = built.injected(gate=True).gate("False", reasons.CONTAINERS_NOT_READY)
    raw = (
        built.set("status.initContainerStatuses", [
            {"name": names.AGENT_CONTAINER, "ready": agent_ready, "state": RUNNING},
        ]).set("status.containerStatuses", [
            {"name": "vllm", "ready": engine_ready,
             "state": RUNNING if running else {"waiting": {"reason": "CrashLoopBackOff"}}},
            {"name": "logs", "ready": True, "state": RUNNING},
        ]).build()
    )  # fmt: skip
    if answered:  # a dotted key: not through the builder's dotted paths
        raw["metadata"]["annotations"][names.ENGINE_READINESS_ANNOTATION] = "vllm"
    return raw


def test_an_engine_held_only_by_its_agents_probe_takes_part() -> None:
    raw = engine_pod(engine_ready=False)
    for seen in (raw, slim_pod(raw)):  # the operator's watch keeps what it needs
        view = pod_view(seen, Role.SINK, "engine-a", 0, None)
        assert view.engine_unready
        assert view.containers_ready
        assert view.joinable
        assert view.workload_started is not None


def test_any_other_reason_to_be_unready_still_holds_the_pod_out() -> None:
    for raw in (
        engine_pod(engine_ready=False, agent_ready=False),  # its agent restarts
        engine_pod(engine_ready=False, running=False),  # the engine is not running
        engine_pod(engine_ready=False, answered=False),  # the engine's own probe
    ):
        view = pod_view(slim_pod(raw), Role.SINK, "engine-a", 0, None)
        assert not view.engine_unready
        assert not view.containers_ready


def test_behind_is_planned_unhealthy_is_not_and_the_gate_waits_for_the_probe() -> None:
    view = pod_view(engine_pod(engine_ready=False), Role.SINK, "engine-a", 0, None)
    behind = agent("e")  # healthy, serves no version of ours
    down = agent("e", engine_healthy=False)
    assert answering([view], {"e": behind}) == {"e"}
    assert answering([view], {"e": down}) == frozenset()
    # The gate waits for the engine container: it opens once the agent's probe passes.
    serving = agent("e", engine_version=5)
    for status in (behind, serving):
        decision = decide(view, status, None, Current(5))
        assert (decision.status, decision.reason) == (False, reasons.CONTAINERS_NOT_READY)
    ready = pod_view(engine_pod(engine_ready=True), Role.SINK, "engine-a", 0, None)
    decision = decide(ready, serving, None, Current(5))
    assert (decision.status, decision.reason) == (True, reasons.SERVES_CURRENT_VERSION)
