"""The `weightsync.io/weights-current` readiness gate: which inference pods may serve. Pure.

A pod's gate is True only while its engine serves the WeightSync's current version:
the version the trainer's source agent last published successfully (a round only
succeeds when every member committed it). Before the first version the gate is False:
engines start from placeholder weights (`--load-format dummy`), which must not serve.
A pod whose agent does not answer is held False too: the operator cannot vouch for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weightsync.api.control import AgentStatus
from weightsync.controller import reasons
from weightsync.controller.workloads import PodView


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


def current_version(source: AgentStatus | None, stored: int | None) -> int | None:
    """The source agent's last published version, or the stored one while it has none
    (a restarted trainer's agent starts empty; the sinks still serve what it sent)."""
    if source is not None and source.version is not None:
        return source.version
    return stored


def served_version(status: AgentStatus | None) -> int | None:
    """The version a sink's engine serves (its agent's view if it reports no engine)."""
    if status is None:
        return None
    if status.engine is not None:
        return None if status.engine.torn else status.engine.version
    return status.version


def decide(
    pod: PodView, status: AgentStatus | None, error: str | None, version: int | None
) -> GateDecision:
    if status is None:
        return GateDecision(
            pod.name,
            False,
            reasons.AGENT_UNREACHABLE,
            reasons.AGENT_UNREACHABLE_MESSAGE.format(error=error or "no status"),
        )
    if status.engine is not None and status.engine.torn:
        return GateDecision(pod.name, False, reasons.ENGINE_TORN, reasons.ENGINE_TORN_MESSAGE)
    if version is None:
        return GateDecision(pod.name, False, reasons.NO_VERSION_YET, reasons.NO_VERSION_YET_MESSAGE)
    served = served_version(status)
    if served == version:
        return GateDecision(
            pod.name,
            True,
            reasons.SERVES_CURRENT_VERSION,
            reasons.SERVES_CURRENT_VERSION_MESSAGE,
        )
    return GateDecision(
        pod.name,
        False,
        reasons.BEHIND_CURRENT_VERSION,
        reasons.BEHIND_CURRENT_VERSION_MESSAGE.format(
            served="no version" if served is None else f"version {served}", version=version
        ),
    )


def gate_changes(
    pods: Sequence[PodView],
    statuses: Mapping[str, AgentStatus],
    errors: Mapping[str, str],
    version: int | None,
) -> list[GateDecision]:
    """Decisions for gated, live pods whose condition differs from what they carry."""
    changes = []
    for pod in pods:
        if not pod.has_gate or pod.terminating:
            continue
        decision = decide(pod, statuses.get(pod.name), errors.get(pod.name), version)
        if (pod.gate_status, pod.gate_reason) != (decision.status_text, decision.reason):
            changes.append(decision)
    return changes
