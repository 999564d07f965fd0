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
