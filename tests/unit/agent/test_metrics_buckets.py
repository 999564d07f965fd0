"""Round-duration buckets fine enough for the quantiles the dashboard draws."""

from __future__ import annotations

import itertools
import math
import random

from prometheus_client import CollectorRegistry

from weightsync.agent.metrics import _ROUND_BUCKETS, AgentMetrics


def test_adjacent_bounds_are_at_most_10_percent_apart_from_10_ms_to_100_s() -> None:
    assert list(_ROUND_BUCKETS) == sorted(set(_ROUND_BUCKETS))
    within = [b for b in _ROUND_BUCKETS if 0.01 <= b <= 100.0]
    assert (within[0], within[-1]) == (0.01, 100.0)
    assert max(high / low for low, high in itertools.pairwise(within)) <= 1.1


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile for a classic histogram: cumulative (le, count)
    pairs, linear interpolation inside the bucket that holds rank q * total."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    raise AssertionError("unreachable: +Inf holds every observation")


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def test_a_drawn_p50_and_p99_are_within_10_percent_of_the_rounds_own() -> None:
    # The agent's own histogram, filled with round durations of the demo's spread and
    # far outside it, read the way Prometheus reads it.
    rng = random.Random(7)
    for scale in (0.02, 0.4, 1.3, 9.0, 40.0):
        for size in (12, 24, 200):
            registry = CollectorRegistry()
            metrics = AgentMetrics("source", registry)
            rounds = [scale * rng.uniform(0.7, 2.0) for _ in range(size)]
            for seconds in rounds:
                metrics.round_succeeded(seconds, 1, 1)
            buckets = [
                (float(s.labels["le"]), s.value)
                for m in registry.collect()
                if m.name == "weightsync_round_duration_seconds"
                for s in m.samples
                if s.name.endswith("_bucket")
            ]
            for q in (0.5, 0.99):
                drawn, own = _histogram_quantile(q, buckets), _nearest_rank(rounds, q)
                assert abs(drawn - own) <= 0.1 * own, (scale, size, q, drawn, own)
