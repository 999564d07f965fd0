"""The agent's Prometheus metrics: one registry per agent, `weightsync_` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Rounds of a 16 GB model take tens of milliseconds on NVLink and seconds over TCP.
# histogram_quantile interpolates inside the bucket that holds the quantile, and the true
# value lies in that bucket too: the drawn one is off by at most the bucket's ratio, so 25
# bounds a decade from 10 ms to 100 s (each 1.097x the one before) keep a drawn p50 or
# p99 within 10% of the rounds' own. A third apart drew the demo's 1,262 ms p99 as 1,470.
# The cost: about 100 series per agent for this histogram.
_ROUND_BUCKETS = (*(float(f"{10 ** (k / 25 - 2):.4g}") for k in range(101)), 120.0)
_PREWARM_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# A recovery pulls a whole model: about a second over RDMA, minutes over TCP.
_RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class AgentMetrics:
    """Labels stay low-cardinality: role, and a failure reason from a fixed set of labels."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.role = role
        self.round_duration = Histogram(
            "weightsync_round_duration_seconds",
            "Duration of a sync round as this agent saw it, header to commit.",
            ["role"],
            buckets=_ROUND_BUCKETS,
            registry=self.registry,
        ).labels(role)
        self.round_bytes = Counter(
            "weightsync_round_bytes_total",
            "Bucket bytes moved by successful rounds.",
            ["role"],
            registry=self.registry,
        ).labels(role)
        self.bandwidth = Gauge(
            "weightsync_round_bandwidth_bytes_per_second",
            "Achieved bandwidth of the last successful round (bytes over round duration).",
            ["role"],
            registry=self.registry,
        ).labels(role)
        self.prewarm_duration = Histogram(
            "weightsync_prewarm_duration_seconds",
            "Time to form and pre-warm a group generation.",
            ["role"],
            buckets=_PREWARM_BUCKETS,
            registry=self.registry,
        ).labels(role)
        # Every label set a counter will have starts at 0, so `increase()` counts the
        # first event too (a series born at 1 shows no increase).
        rounds = Counter(
            "weightsync_rounds_total",
            "Rounds this agent took part in, by result (ok, failed).",
            ["role", "result"],
            registry=self.registry,
        )
        self.rounds_ok, self.rounds_failed = (
            rounds.labels(role, "ok"),
            rounds.labels(role, "failed"),
        )
        self.round_failures = Counter(
            "weightsync_round_failures_total",
            "Failed rounds by reason and by the stage where they failed.",
            ["role", "reason", "stage"],
            registry=self.registry,
        )
        self.current_version = Gauge(
            "weightsync_current_version",
            "The weight version this agent last committed (-1 before the first).",
            ["role"],
            registry=self.registry,
        ).labels(role)
        self.current_version.set(-1)
        self.generation = Gauge(
            "weightsync_group_generation",
            "The active group generation (0 before the first).",
            ["role"],
            registry=self.registry,
        ).labels(role)

        self.recovery_duration = Histogram(
            "weightsync_recovery_duration_seconds",
            "Duration of a successful P2P recovery, request to engine commit. Failed ones"
            " count only in weightsync_recovery_failures_total (the alert relies on it).",
            ["role"],
            buckets=_RECOVERY_BUCKETS,
            registry=self.registry,
        ).labels(role)
        self.recovery_bytes = Counter(
            "weightsync_recovery_bytes_total",
            "Bytes pulled from holders by successful recoveries.",
            ["role"],
            registry=self.registry,
        ).labels(role)
        self.recovery_bandwidth = Gauge(
            "weightsync_recovery_bandwidth_bytes_per_second",
            "Bandwidth of the last successful recovery (bytes over its whole duration).",
            ["role"],
            registry=self.registry,
        ).labels(role)
        recoveries = Counter(
            "weightsync_recoveries_total",
            "Recoveries this agent ran, by result (done, failed): a sink's P2P pulls, a Colocated"
            " source's reloads of its engine from the held copy.",
            ["role", "result"],
            registry=self.registry,
        )
        self.recoveries_done = recoveries.labels(role, "done")
        self.recoveries_failed = recoveries.labels(role, "failed")
        self.recovery_last_duration = Gauge(
            "weightsync_recovery_last_duration_seconds",
            "Duration of this agent's last successful recovery (0: none yet). A pod often"
            " recovers before its first scrape, which no histogram rate can show.",
            ["role"],
            registry=self.registry,
        ).labels(role)
        self.recovery_failures = Counter(
            "weightsync_recovery_failures_total",
            "Failed recoveries by reason.",
            ["role", "reason"],
            registry=self.registry,
        )
        self.held_version = Gauge(
            "weightsync_held_version",
            "The version this agent holds in host memory for P2P pulls (-1: none).",
            ["role"],
            registry=self.registry,
        ).labels(role)
        self.held_version.set(-1)
        self.holder_host_bytes = Gauge(
            "weightsync_holder_host_memory_bytes",
            "Host memory the holder has registered (page-locked on GPU): two model-sized"
            " buffers once ready.",
            ["role"],
            registry=self.registry,
        ).labels(role)

    def round_succeeded(self, duration_seconds: float, nbytes: int, version: int) -> None:
        self.round_duration.observe(duration_seconds)
        self.round_bytes.inc(nbytes)
        self.rounds_ok.inc()
        if duration_seconds > 0:
            self.bandwidth.set(nbytes / duration_seconds)
        self.current_version.set(version)

    def round_failed(self, duration_seconds: float, reason: str, stage: str = "") -> None:
        self.round_duration.observe(duration_seconds)
        self.rounds_failed.inc()
        self.round_failures.labels(self.role, reason, stage or "prepare").inc()

    def recovery_succeeded(self, duration_seconds: float, nbytes: int, version: int) -> None:
        self.recovery_duration.observe(duration_seconds)
        self.recovery_bytes.inc(nbytes)
        self.recoveries_done.inc()
        self.recovery_last_duration.set(duration_seconds)
        if duration_seconds > 0:
            self.recovery_bandwidth.set(nbytes / duration_seconds)
        self.current_version.set(version)

    def recovery_failed(self, reason: str) -> None:
        self.recoveries_failed.inc()
        self.recovery_failures.labels(self.role, reason).inc()
