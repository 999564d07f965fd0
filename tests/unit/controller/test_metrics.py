"""The operator's counters exist at 0 for every label set they will have."""

from __future__ import annotations

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
