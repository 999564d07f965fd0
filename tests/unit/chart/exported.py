"""The metric names weightsync's code exports, read from its Prometheus registries."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

# Sample-name suffixes of each metric type, as prometheus_client exposes them.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}

# Named in issue 7 for the agent's P2P recovery before it exports them: the dashboard and
# the alerts use exactly these. Types follow from the suffixes: a histogram of successful
# recoveries, a counter of pulled bytes, a counter of failures by `reason`.
AWAITED = frozenset(
    {
        "weightsync_recovery_duration_seconds_bucket",
        "weightsync_recovery_duration_seconds_count",
        "weightsync_recovery_bytes_total",
        "weightsync_recovery_failures_total",
    }
)


def sample_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
    return names


def exported() -> set[str]:
    """Every sample name the agent and the operator expose."""
    from weightsync.agent.metrics import AgentMetrics
    from weightsync.controller import metrics as operator_metrics

    return sample_names(AgentMetrics("sink").registry) | sample_names(operator_metrics.REGISTRY)
