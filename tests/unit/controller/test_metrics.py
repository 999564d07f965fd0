"""The operator's counters exist at 0 for every label set they will have; the
per-WeightSync gauges follow the status a pass wrote (alerts read them)."""

from __future__ import annotations

from weightsync.api.v1alpha1 import WeightSyncStatus
from weightsync.controller import metrics


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.REGISTRY.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }


def test_counters_are_born_at_zero_so_the_first_event_counts() -> None:
    samples = _samples()
    for result in ("ok", "waiting", "invalid", "gone", "error"):
        assert ("weightsync_operator_reconciles_total", (("result", result),)) in samples
    for result in ("started", "done", "failed", "refused"):
        assert ("weightsync_operator_recoveries_total", (("result", result),)) in samples
    failed = (
        "weightsync_operator_agent_requests_total",
        (("result", "unreachable"), ("route", "recover")),
    )
    assert failed in samples
    denied = (
        "weightsync_operator_admission_requests_total",
        (("result", "denied"), ("webhook", "validate-claims")),
    )
    assert denied in samples


def _status(degraded: str, version: int | None) -> WeightSyncStatus:
    def condition(kind: str, status: str) -> dict[str, object]:
        return {
            "type": kind,
            "status": status,
            "reason": "Testing",
            "message": "set by the test",
            "lastTransitionTime": "2026-11-28T00:00:00Z",
            "observedGeneration": 1,
        }

    return WeightSyncStatus.model_validate(
        {
            "currentVersion": version,
            "conditions": [condition("Degraded", degraded), condition("Ready", "True")],
        }
    )


def _condition(name: str, kind: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(
        "weightsync_operator_condition", {"namespace": "rl", "name": name, "condition": kind}
    )


def test_conditions_are_gauges_that_follow_the_status_and_go_with_the_weightsync() -> None:
    metrics.record_status("rl", "sync-a", _status("True", 3))
    assert _condition("sync-a", "Degraded") == 1
    assert _condition("sync-a", "Ready") == 1
    metrics.record_status("rl", "sync-a", _status("Unknown", 4))
    assert _condition("sync-a", "Degraded") == 0
    metrics.forget("rl", "sync-a")
    assert _condition("sync-a", "Degraded") is None
    assert _condition("sync-a", "Ready") is None
