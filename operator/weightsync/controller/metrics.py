"""The operator's Prometheus metrics (`weightsync_operator_*`), served on their own port.

Labels are low-cardinality: results and webhook names, plus namespace/name on the
per-WeightSync gauges (one series per WeightSync, one per condition type).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from weightsync.api.conditions import ConditionStatus, ConditionType

if TYPE_CHECKING:
    from weightsync.api.v1alpha1 import WeightSyncStatus


class ApiResult(StrEnum):
    """`api_requests_total`'s `result`."""

    OK = "ok"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    EXPIRED = "expired"  # a watch's list is too old (HTTP 410)
    ERROR = "error"
    UNREACHABLE = "unreachable"


class AdmissionResult(StrEnum):
    """`admission_requests_total`'s `result`."""

    INJECTED = "injected"
    SKIPPED = "skipped"
    ALLOWED = "allowed"
    DENIED = "denied"
    ERROR = "error"


class AgentRequestResult(StrEnum):
    """`agent_requests_total`'s `result`."""

    OK = "ok"
    REJECTED = "rejected"  # the agent answered another status than the route's
    UNREACHABLE = "unreachable"
    INVALID = "invalid"  # a reply that does not parse, or names another pod


class RecoveryResult(StrEnum):
    """`recoveries_total`'s `result`."""

    STARTED = "started"
    DONE = "done"
    FAILED = "failed"
    REFUSED = "refused"  # the agent did not start it (busy, unreachable)


REGISTRY = CollectorRegistry(auto_describe=True)
PREFIX = "weightsync_operator"

RECONCILES = Counter(
    f"{PREFIX}_reconciles_total",
    "Reconcile passes over a WeightSync, by result (ok, waiting, invalid, error).",
    ["result"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    f"{PREFIX}_reconcile_duration_seconds",
    "How long one reconcile pass took: deciding and writing (agents are polled apart,"
    " see agent_poll_duration_seconds; newcomers' first answers are included).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1, 2, 5, 10, 30),
    registry=REGISTRY,
)
API_REQUESTS = Counter(
    f"{PREFIX}_api_requests_total",
    "Requests to the Kubernetes API server (watches aside), by verb (get, list, patch,"
    " apply, delete), resource and result (ok, not_found, conflict, error, unreachable).",
    ["verb", "resource", "result"],
    registry=REGISTRY,
)
AGENT_POLL_DURATION = Histogram(
    f"{PREFIX}_agent_poll_duration_seconds",
    "How long one poll of a WeightSync's agents (GET /v1/status to each) took.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
    registry=REGISTRY,
)
PLAN_BYTES = Counter(
    f"{PREFIX}_plan_bytes_total",
    "Bytes of membership plans sent to agents (PUT /v1/plan bodies).",
    registry=REGISTRY,
)
ADMISSIONS = Counter(
    f"{PREFIX}_admission_requests_total",
    "Admission reviews answered, by webhook and result (injected, skipped, allowed, denied).",
    ["webhook", "result"],
    registry=REGISTRY,
)
AGENT_REQUESTS = Counter(
    f"{PREFIX}_agent_requests_total",
    "Control-API requests to agents, by route (status, plan, recover) and result.",
    ["route", "result"],
    registry=REGISTRY,
)
GENERATIONS_PLANNED = Counter(
    f"{PREFIX}_generations_planned_total",
    "Group generations planned and delivered.",
    registry=REGISTRY,
)
RECOVERIES = Counter(
    f"{PREFIX}_recoveries_total",
    "P2P recoveries of inference pods, by result (started, done, failed, refused).",
    ["result"],
    registry=REGISTRY,
)
RECOVERY_DURATION = Histogram(
    f"{PREFIX}_recovery_duration_seconds",
    "How long a successful recovery took, as its agent measured it (engine load included).",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
LEADER = Gauge(
    f"{PREFIX}_leader",
    "1 while this replica holds the leader Lease and reconciles; 0 while it stands by and"
    " serves admission only (the WeightSyncOperatorDown alert: no replica at 1).",
    registry=REGISTRY,
)
GROUP_GENERATION = Gauge(
    f"{PREFIX}_group_generation",
    "The planned group generation of each WeightSync.",
    ["namespace", "name"],
    registry=REGISTRY,
)
MEMBERS = Gauge(
    f"{PREFIX}_members",
    "Ranks in the planned group generation of each WeightSync.",
    ["namespace", "name"],
    registry=REGISTRY,
)
CURRENT_VERSION = Gauge(
    f"{PREFIX}_current_version",
    "The current weight version of each WeightSync (-1 before the first).",
    ["namespace", "name"],
    registry=REGISTRY,
)
CONDITION = Gauge(
    f"{PREFIX}_condition",
    "Each condition of each WeightSync as last written: 1 when its status is True, 0 when"
    " False or Unknown (alerts read Degraded and Ready from it).",
    ["namespace", "name", "condition"],
    registry=REGISTRY,
)


# Every label set a counter will have starts at 0: a series born at its first event
# shows no increase() for that event (the first failure would never count).
for _result in ("ok", "waiting", "invalid", "gone", "error"):
    RECONCILES.labels(_result)
_INJECT = (AdmissionResult.INJECTED, AdmissionResult.SKIPPED, AdmissionResult.DENIED)
_VALIDATE = (AdmissionResult.ALLOWED, AdmissionResult.DENIED)
for _webhook, _results in (("inject-agent", _INJECT), ("validate-claims", _VALIDATE)):
    for _admitted in (*_results, AdmissionResult.ERROR):
        ADMISSIONS.labels(_webhook, _admitted)
for _route in ("status", "plan", "recover"):
    for _answer in AgentRequestResult:
        AGENT_REQUESTS.labels(_route, _answer)
for _recovery in RecoveryResult:
    RECOVERIES.labels(_recovery)
for _verb, _resource in (
    ("get", "weightsyncs"),
    ("patch", "weightsyncs/status"),
    ("patch", "pods/status"),
    ("list", "pods"),
    ("get", "statefulsets"),
    ("get", "deployments"),
    ("list", "replicasets"),
):
    for _api in (ApiResult.OK, ApiResult.ERROR, ApiResult.UNREACHABLE):
        API_REQUESTS.labels(_verb, _resource, _api)


def record_status(namespace: str, name: str, status: WeightSyncStatus) -> None:
    """The gauges a pass sets from the status it wrote."""
    GROUP_GENERATION.labels(namespace, name).set(status.group_generation or 0)
    MEMBERS.labels(namespace, name).set(status.member_count or 0)
    version = status.current_version
    CURRENT_VERSION.labels(namespace, name).set(-1 if version is None else version)
    for condition in status.conditions:
        true = condition.status == ConditionStatus.TRUE
        CONDITION.labels(namespace, name, condition.type).set(1 if true else 0)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted WeightSync's series."""
    for gauge in (GROUP_GENERATION, MEMBERS, CURRENT_VERSION):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            continue
    for condition in ConditionType:
        try:
            CONDITION.remove(namespace, name, condition)
        except KeyError:
            continue


def serve(port: int, host: str = "0.0.0.0") -> None:  # noqa: S104 - Prometheus scrapes the pod IP
    """Serve `/metrics` from a background thread (prometheus-client's own server)."""
    start_http_server(port, addr=host, registry=REGISTRY)
