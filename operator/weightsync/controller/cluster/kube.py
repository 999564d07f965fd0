"""The operator's calls to the API server: reads through the official (synchronous)
client, writes through `writer` (`apiwriter`, on the event loop).

The reads block: async code calls them with `asyncio.to_thread`. Objects come back as
plain dicts in the API server's JSON shape, so the pure modules never see the client's
model classes: reads skip them altogether (`_preload_content=False`, the JSON parsed as
it came), since building a pod's model objects costs milliseconds and a thousand of them
cost seconds. The writes here (an Event, a token Secret, a pod deleted) are coroutines
that send their request through the controller's one writer (`apiwriter` says why).
Every request is counted by verb, resource and result
(`weightsync_operator_api_requests_total`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import metrics, names
from weightsync.controller.cluster.apiwriter import ApiWriter, api_path
from weightsync.controller.cluster.cache import Indexes, deployment_of
from weightsync.controller.membership.owners import WorkloadRef, controller_ref
from weightsync.controller.membership.workloads import World, template_labelled

NOT_FOUND = 404
CONFLICT = 409
# For the chart's RBAC check (tests/unit/chart): the writes below, sent through `writer`,
# and the reads of other projects' workloads as custom objects (`_CUSTOM`).
API_CALLS = (
    ("", "events", "create"), ("", "secrets", "create"), ("", "secrets", "update"),
    ("", "pods", "delete"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "get"), ("jobset.x-k8s.io", "jobsets", "get"),
)  # fmt: skip
# The workloads of other projects, read as custom objects: LeaderWorkerSet (v0.7) and
# JobSet (v0.10). Their reads are in `API_CALLS` for the chart's RBAC check.
_CUSTOM = {
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
    "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
}
# The label the JobSet controller puts on its Jobs, naming the JobSet.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
# Connections the official client keeps to the API server (its default: 5 per CPU).
CONNECTIONS = 16
# (connect, read) seconds for every request. The official client waits forever by
# default, and a request on a connection that an API-server restart left dangling then
# held its pass, and every later pass of its WeightSync, for good (the fault matrix saw
# an operator stop reconciling after a restart). The largest read, 1,000 pods, takes
# about 2 s.
REQUEST_TIMEOUT = (5.0, 30.0)


def load_config() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG)."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = CONNECTIONS
    return client.ApiClient(configuration)


def _result(error: ApiException) -> metrics.ApiResult:
    if error.status == NOT_FOUND:
        return metrics.ApiResult.NOT_FOUND
    if error.status == CONFLICT:
        return metrics.ApiResult.CONFLICT
    return metrics.ApiResult.ERROR


def selector_string(selector: Mapping[str, Any] | None) -> str:
    """A LabelSelector as the `labelSelector` query parameter."""
    if not selector:
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In":
            parts.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
        else:
            raise ValueError(f"unknown label selector operator {op!r}")
    return ",".join(parts)


class NotCachedError(LookupError):
    """What `Kube.observe(cached_only=True)` needs is not in the watches' caches."""


# How `Kube.observe` reads: (namespace, the watches' caches, whether only from them).
_Read = tuple[str, Indexes, bool]


class Kube:
    """The API calls of the reconcile and the webhook: reads (blocking), writes (async)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.writer = ApiWriter(api)  # every write, on the event loop (`apiwriter`)
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.coordination = client.CoordinationV1Api(api)

    def _call(
        self, verb: str, resource: str, call: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> bytes:
        """One request and its raw reply, counted."""
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        try:
            response = call(*args, _preload_content=False, **kwargs)
        except ApiException as error:
            metrics.API_REQUESTS.labels(verb, resource, _result(error)).inc()
            raise
        except Exception:
            metrics.API_REQUESTS.labels(verb, resource, metrics.ApiResult.UNREACHABLE).inc()
            raise
        try:
            data = response.data
        finally:
            response.release_conn()
        metrics.API_REQUESTS.labels(verb, resource, metrics.ApiResult.OK).inc()
        return bytes(data or b"")

    def _get(self, resource: str, call: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = json.loads(self._call("get", resource, call, *args))
        except ApiException as error:
            if error.status == NOT_FOUND:
                return None
            raise
        return found

    def _list(
        self, resource: str, call: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> list[dict[str, Any]]:
        listing = json.loads(self._call("list", resource, call, *args, **kwargs) or b"{}")
        return list(listing.get("items") or [])

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The leader-election Lease (`cluster.leases`), None if there is none yet."""
        return self._get("leases", self.coordination.read_namespaced_lease, name, namespace)

    # -- WeightSyncs ---------------------------------------------------------------

    def get_weightsync(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(
            "weightsyncs", self.custom.get_namespaced_custom_object,
            GROUP, VERSION, namespace, PLURAL, name,
        )  # fmt: skip

    def list_weightsyncs(self, namespace: str) -> list[dict[str, Any]]:
        return self._list(
            "weightsyncs", self.custom.list_namespaced_custom_object,
            GROUP, VERSION, namespace, PLURAL,
        )  # fmt: skip

    def weightsyncs(self, namespace: str, indexes: Indexes | None) -> Sequence[Mapping[str, Any]]:
        """The namespace's WeightSyncs from the watch (`indexes`), listed until it is bound."""
        watched = indexes.weightsyncs(namespace) if indexes is not None else None
        return watched if watched is not None else self.list_weightsyncs(namespace)

    # -- workloads -----------------------------------------------------------------

    def observe(
        self,
        namespace: str,
        trainer: WorkloadRef,
        engines: list[WorkloadRef],
        indexes: Indexes,
        *,
        cached_only: bool = False,
    ) -> World:
        """The trainer and inference workloads, the controllers between them and their
        pods (`owners`: ReplicaSets, leader StatefulSets, Jobs), and those pods.

        Pods come from the watch (`indexes`) for every controller whose pod template
        carries the inject label; the others' pods (no sidecar, reported) are listed.
        `cached_only`: raise `NotCachedError` rather than call the API (so that the event
        loop may call it: it then blocks on nothing).
        """
        read = (namespace, indexes, cached_only)
        trainer_obj = self._workload(read, trainer.kind, trainer.name)
        found = {ref.name: self._workload(read, ref.kind, ref.name) for ref in engines}
        between: dict[str, Mapping[str, Any]] = {}
        for ref in [trainer, *engines]:
            obj = trainer_obj if ref is trainer else found[ref.name]
            if obj is not None:
                for controller in self._controllers(read, ref.kind, obj):
                    between[controller["metadata"]["uid"]] = controller
        owners = [*between.values()]
        if trainer_obj is not None and trainer.kind in ("StatefulSet", "Job"):
            owners.append(trainer_obj)
        pods: dict[str, Mapping[str, Any]] = {}
        for owner in owners:
            for pod in self._owned_pods(read, owner):
                pods[pod["metadata"]["uid"]] = pod
        return World(trainer_obj, found, list(between.values()), list(pods.values()))

    def _workload(self, read: _Read, kind: str, name: str) -> Mapping[str, Any] | None:
        namespace, indexes, cached_only = read
        watched = indexes.workload(kind, namespace, name)
        if watched is not None:
            return watched[0]
        if cached_only:
            raise NotCachedError(f"{kind} {namespace}/{name}")
        if kind in _CUSTOM:
            group, version, plural = _CUSTOM[kind]
            return self._get(
                plural, self.custom.get_namespaced_custom_object,
                group, version, namespace, plural, name,
            )  # fmt: skip
        if kind == "Job":
            return self._get("jobs", self.batch.read_namespaced_job, name, namespace)
        if kind == "StatefulSet":
            return self._get(
                "statefulsets", self.apps.read_namespaced_stateful_set, name, namespace
            )
        return self._get("deployments", self.apps.read_namespaced_deployment, name, namespace)

    def _controllers(
        self, read: _Read, kind: str, workload: Mapping[str, Any]
    ) -> Sequence[Mapping[str, Any]]:
        """The controllers between a workload and its pods (none: it owns them itself)."""
        if kind == "Deployment":
            return self._replicasets(read, workload)
        if kind == "LeaderWorkerSet":
            # The leader StatefulSet has the LeaderWorkerSet's name and is controlled by it.
            leaders = self._workload(read, "StatefulSet", workload["metadata"]["name"])
            owner = controller_ref(leaders) if leaders is not None else None
            mine = owner is not None and owner.get("uid") == workload["metadata"]["uid"]
            return [leaders] if leaders is not None and mine else []
        if kind == "JobSet":
            return self._jobs(read, workload)
        return []

    def _replicasets(
        self, read: _Read, deployment: Mapping[str, Any]
    ) -> Sequence[Mapping[str, Any]]:
        namespace, indexes, cached_only = read
        watched = indexes.replicasets_of(namespace, deployment["metadata"]["uid"])
        if watched is not None:
            return watched
        if cached_only:
            raise NotCachedError(f"the ReplicaSets of {namespace}/{deployment['metadata']['name']}")
        selector = selector_string(deployment["spec"].get("selector"))
        return self._list(
            "replicasets", self.apps.list_namespaced_replica_set, namespace,
            label_selector=selector,
        )  # fmt: skip

    def _jobs(self, read: _Read, jobset: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        namespace, indexes, cached_only = read
        watched = indexes.jobs_of(namespace, jobset["metadata"]["uid"])
        if watched is not None:
            return watched
        if cached_only:
            raise NotCachedError(f"the Jobs of {namespace}/{jobset['metadata']['name']}")
        return self._list(
            "jobs", self.batch.list_namespaced_job, namespace,
            label_selector=f"{JOBSET_NAME_LABEL}={jobset['metadata']['name']}",
        )  # fmt: skip

    def _owned_pods(self, read: _Read, owner: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        namespace, indexes, cached_only = read
        spec, status = owner.get("spec") or {}, owner.get("status") or {}
        if not spec.get("completions") and not spec.get("replicas") and not status.get("replicas"):
            return []  # a ReplicaSet of an old revision, scaled to nothing (a Job has none)
        if template_labelled(owner):
            watched = indexes.pods_of(namespace, owner["metadata"]["uid"])
            if watched is not None:
                return watched
        if cached_only:
            raise NotCachedError(f"the pods of {namespace}/{owner['metadata']['name']}")
        selector = selector_string(owner["spec"].get("selector"))
        return self._list("pods", self.core.list_namespaced_pod, namespace, label_selector=selector)

    def statefulset_owner(
        self, namespace: str, name: str, indexes: Indexes | None = None
    ) -> Mapping[str, Any] | None:
        """The controller reference of StatefulSet `name` (a LeaderWorkerSet's, for a
        leader StatefulSet), if any (for the webhook): from the watch, else one GET."""
        watched = indexes.workload("StatefulSet", namespace, name) if indexes else None
        sts = watched[0] if watched is not None else None
        if sts is None:
            sts = self._get("statefulsets", self.apps.read_namespaced_stateful_set, name, namespace)
        return controller_ref(sts) if sts else None

    def job(
        self, namespace: str, name: str, indexes: Indexes | None = None
    ) -> Mapping[str, Any] | None:
        """Job `name` (for the webhook: its JobSet and completions), from the watch, else
        one GET."""
        watched = indexes.workload("Job", namespace, name) if indexes else None
        if watched is not None and watched[0] is not None:
            return watched[0]
        return self._get("jobs", self.batch.read_namespaced_job, name, namespace)

    def replicaset_owner(
        self, namespace: str, name: str, indexes: Indexes | None = None
    ) -> str | None:
        """The Deployment that controls ReplicaSet `name`, if any (for the webhook): from
        the watch, else (unbound, or the ReplicaSet is newer than the watch) one GET."""
        watched = indexes.replicaset_owner(namespace, name) if indexes is not None else None
        if watched is not None:
            return watched[0]
        rs = self._get("replicasets", self.apps.read_namespaced_replica_set, name, namespace)
        return deployment_of(rs) if rs else None

    # -- writes (`writer`) ----------------------------------------------------------

    async def create_event(self, namespace: str, body: dict[str, Any]) -> None:
        path = api_path("", "v1", "events", namespace=namespace)
        await self.writer.create(path, body, resource="events")

    async def write_token(self, namespace: str, sync: Mapping[str, Any], token: str) -> None:
        """Write the WeightSync's agent token Secret (owned by the WeightSync): created, or
        replaced whole where one exists (a WeightSync deleted and created again before the
        old Secret was collected: its owner is the new one now). Never read back
        (`controller.tokens`): a PATCH answers with the whole Secret, dry run included, so
        the operator may not patch Secrets; a replace answers with what it wrote."""
        name = names.token_secret_name(sync["metadata"]["name"])
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "labels": {names.SYNC_LABEL: names.sync_label(sync["metadata"]["name"])},
                "ownerReferences": [owner_reference(sync)],
            },
            "type": "Opaque",
            "stringData": {names.TOKEN_KEY: token},
        }
        secrets = api_path("", "v1", "secrets", namespace=namespace)
        try:
            await self.writer.create(secrets, body, resource="secrets")
        except ApiException as error:
            if error.status != CONFLICT:
                raise
            await self.writer.replace(f"{secrets}/{name}", body, resource="secrets")

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Delete exactly this pod (a UID precondition spares a same-named replacement)."""
        path = api_path("", "v1", "pods", namespace=namespace, name=name)
        try:
            await self.writer.delete(path, resource="pods", options={"preconditions": {"uid": uid}})
        except ApiException as error:
            if error.status not in (NOT_FOUND, CONFLICT):
                raise


def pod_condition(
    *, kind: str, status: str, reason: str, message: str, since: str
) -> dict[str, Any]:
    """A pod condition as the API server stores it."""
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "lastProbeTime": None,
    }


def owner_reference(sync: Mapping[str, Any]) -> dict[str, Any]:
    meta = sync["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WeightSync",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def api_unavailable(error: BaseException) -> bool:
    """Whether `error` says the API server is away (down, restarting, overloaded) rather
    than that a request was wrong: the next pass retries, nothing to debug."""
    if isinstance(error, ApiException):
        return error.status == 429 or (error.status or 0) >= 500
    return isinstance(error, urllib3.exceptions.HTTPError | ConnectionError)
