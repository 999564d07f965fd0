"""kopf registrations. Thin: each handler calls the reconciler or an admission function.

* create / update / resume -> one reconcile pass (`reconcile.Reconciler.run`); a spec the
  operator cannot act on is a `PermanentError` (its status already says why, with a
  Warning Event). A missing workload is waited for: the status and a Warning Event say
  so once, and the timer's pass finds it (a kopf `TemporaryError` logged an ERROR at
  every retry for as long as the workload was missing).
* a timer per WeightSync -> a sweep of its agents' status, then the same pass (drift);
  another asks only the trainer's agents, every second, and runs a pass when one of
  their answers changed (a version published, a round reported, a generation warm).
* pod events (labelled pods only: the watch itself is filtered server-side) -> a pass
  for the WeightSync that selects the pod (all of the namespace's if it carries no
  sync label yet); passes coalesce (`scheduling`), so a burst costs one or two.
* indexes of labelled pods and of WeightSyncs (`cache`): what passes and webhooks read
  instead of listing; every handler binds them for the passes it starts.
* delete -> open the readiness gates the WeightSync held (the finalizer's job).
* admission -> `admission.review.inject` and `admission.review.claim_errors`.

With leader election every replica registers the webhooks and the indexes
(`register_serving`), the Lease's holder the rest besides (`register_leading`).

Retries are kopf's: every handler but the webhooks (the API server's timeout bounds
those) is registered with `timeout=` and `backoff=` from `runtime.timing`
(tests/unit/controller/test_handler_timing.py walks the registry).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import metrics, names
from weightsync.controller.admission import review
from weightsync.controller.admission.sidecar import AgentTemplate
from weightsync.controller.admission.webhook_config import INJECT_AGENT, VALIDATE_CLAIMS
from weightsync.controller.agents.client import AgentClient
from weightsync.controller.cluster import pod_actions
from weightsync.controller.cluster.cache import (
    BODIES_INDEX,
    DEPLOYMENTS_INDEX,
    JOBS_BY_OWNER_INDEX,
    JOBS_INDEX,
    JOBSETS_INDEX,
    LEADERWORKERSETS_INDEX,
    REPLICASET_OWNERS_INDEX,
    REPLICASETS_INDEX,
    STATEFULSETS_INDEX,
    WEIGHTSYNCS_INDEX,
    Indexes,
    pod_key,
    replicaset_owner,
    slim_weightsync,
    slim_workload,
)
from weightsync.controller.cluster.events import EventPoster
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.cluster.podwatch import DELETED, PodWatch
from weightsync.controller.passes.reconcile import (
    SOURCE_POLL_SECONDS,
    Outcome,
    Reconciler,
    Result,
    log_pass_failure,
)
from weightsync.controller.runtime.tasks import Tasks
from weightsync.controller.runtime.timing import HANDLER_BACKOFF_SECONDS as BACKOFF
from weightsync.controller.runtime.timing import HANDLER_TIMEOUT_SECONDS as TIMEOUT
from weightsync.controller.settings import OperatorSettings

log = logging.getLogger(__name__)


@dataclass
class Shared:
    """What the handlers share; built once in `main`."""

    settings: OperatorSettings
    kube: Kube
    agents: AgentClient
    reconciler: Reconciler
    events: EventPoster  # the passes' (`reconciler` posts through it)
    template: AgentTemplate
    indexes: Indexes
    namespaces: tuple[str, ...] = ()  # served namespaces; empty: the whole cluster
    tasks: Tasks = field(default_factory=Tasks)  # every background task (`runtime.tasks`)

    def serves(self, namespace: str | None) -> bool:
        """kopf registers webhooks cluster-wide (no namespaceSelector); an operator that
        serves some namespaces leaves admission in the others alone."""
        return not self.namespaces or namespace in self.namespaces

    def pod_changed(self, change: str, namespace: str, pod: Mapping[str, Any]) -> None:
        """A labelled pod changed (`podwatch`): a pass for its WeightSync, after its gate
        is closed if it is restarting behind an open one."""
        labels = (pod.get("metadata") or {}).get("labels") or {}
        label = labels.get(names.SYNC_LABEL)
        index = self.indexes.weightsyncs(namespace) or []
        known = sorted({str(s["metadata"]["name"]) for s in index})
        # The label is the WeightSync's name or, for a long name, a hash of it.
        targets = [n for n in known if names.sync_label(n) == label] or known
        if label and change != DELETED and pod_actions.restarting_behind_open_gate(pod):
            name = str(pod["metadata"]["name"])
            task = self.tasks.spawn(
                f"close gate {namespace}/{name}", self._close_gate(namespace, name, targets)
            )
            task.add_done_callback(self._done)
            return
        for target in targets:
            self.reconciler.request(namespace, target)

    async def _close_gate(self, namespace: str, pod: str, targets: list[str]) -> None:
        try:
            await pod_actions.close_gate_at_once(self.kube, namespace, pod)
        finally:
            for target in targets:
                self.reconciler.request(namespace, target)

    def _done(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if isinstance(error, Exception):
            log_pass_failure("closing a gate at once", error)


def _raise_for(result: Result) -> None:
    if result.outcome in (Outcome.OK, Outcome.GONE):
        return
    if result.outcome is Outcome.WAITING:  # the resync timer's next pass looks again
        log.info("waiting: %s", result.message)
        return
    raise kopf.PermanentError(result.message)


def _namespaced(namespace: str | None) -> str:
    # WeightSyncs and pods are namespaced; kopf types the field for cluster-scoped kinds too.
    if not namespace:
        raise kopf.PermanentError("a namespaced object arrived without a namespace")
    return namespace


def register(registry: kopf.OperatorRegistry, shared: Shared, pod_watch: PodWatch) -> None:
    """Register every handler on `registry` (no module-level registration)."""
    register_serving(registry, shared)
    _register_reconcile(registry, shared, pod_watch)


def register_serving(registry: kopf.OperatorRegistry, shared: Shared) -> None:
    """What every replica runs (`controller.leader`): the webhooks and what they read."""
    _register_reads(registry, shared)
    _register_admission(registry, shared)


def register_leading(registry: kopf.OperatorRegistry, shared: Shared, pod_watch: PodWatch) -> None:
    """What only the Lease's holder runs: the reconcile, its timers and the pod watch (with
    indexes of its own: kopf runs an operator's handlers once its own are filled)."""
    _register_reads(registry, shared)
    _register_reconcile(registry, shared, pod_watch)


def _register_reads(registry: kopf.OperatorRegistry, shared: Shared) -> None:
    """kopf's login and the indexes (`cache`) that passes and webhooks read."""
    resource = (GROUP, VERSION, PLURAL)

    # kopf's default login handlers live on its default registry; ours needs its own.
    @kopf.on.login(registry=registry, timeout=TIMEOUT, backoff=BACKOFF)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info: kopf.ConnectionInfo | None = kopf.login_via_client(**kwargs)
        return info

    # Index functions are coroutines: kopf runs plain functions in its thread pool, and
    # a thousand pod events would each cost a hop to a thread and back.
    @kopf.index(
        *resource, registry=registry, id=WEIGHTSYNCS_INDEX, timeout=TIMEOUT, backoff=BACKOFF
    )
    async def weightsyncs_by_namespace(
        namespace: str | None, body: kopf.Body, **_: Any
    ) -> dict[str, dict[str, Any]]:
        return {_namespaced(namespace): slim_weightsync(body)}

    @kopf.index(*resource, registry=registry, id=BODIES_INDEX, timeout=TIMEOUT, backoff=BACKOFF)
    async def weightsync_bodies(
        namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]]:
        return {(_namespaced(namespace), name): dict(body)}

    _register_workload_indexes(registry)


def _register_reconcile(
    registry: kopf.OperatorRegistry, shared: Shared, pod_watch: PodWatch
) -> None:
    """The reconcile, its timers, the finalizer's release and the pod watch."""
    settings = shared.settings
    reconciler = shared.reconciler
    resource = (GROUP, VERSION, PLURAL)
    bind = shared.indexes.bind

    @kopf.on.create(*resource, registry=registry, id="reconcile", timeout=TIMEOUT, backoff=BACKOFF)
    @kopf.on.update(*resource, registry=registry, id="reconcile", timeout=TIMEOUT, backoff=BACKOFF)
    @kopf.on.resume(*resource, registry=registry, id="reconcile", timeout=TIMEOUT, backoff=BACKOFF)
    async def reconcile(namespace: str | None, name: str, **kwargs: Any) -> None:
        bind(kwargs)
        result = await reconciler.run(_namespaced(namespace), name)
        _raise_for(result)

    @kopf.timer(
        *resource,
        registry=registry,
        id="resync",
        interval=settings.resync_seconds,
        timeout=TIMEOUT,
        backoff=BACKOFF,
    )
    async def resync(namespace: str | None, name: str, **kwargs: Any) -> None:
        bind(kwargs)
        # Errors are the next tick's business: a timer must not back off for minutes.
        try:
            await reconciler.resync(_namespaced(namespace), name)
        except Exception as error:
            log_pass_failure(f"resync of {namespace}/{name}", error)

    @kopf.timer(
        *resource,
        registry=registry,
        id="sources",
        interval=SOURCE_POLL_SECONDS,
        timeout=TIMEOUT,
        backoff=BACKOFF,
    )
    async def sources(namespace: str | None, name: str, **kwargs: Any) -> None:
        bind(kwargs)
        try:
            await reconciler.watch_sources(_namespaced(namespace), name)
        except Exception as error:
            log_pass_failure(f"source poll of {namespace}/{name}", error)

    @kopf.on.delete(*resource, registry=registry, id="release", timeout=TIMEOUT, backoff=BACKOFF)
    async def release(namespace: str | None, name: str, body: kopf.Body, **kwargs: Any) -> None:
        bind(kwargs)
        namespace = _namespaced(namespace)
        await reconciler.release(namespace, dict(body))
        log.info("released the pods of %s/%s", namespace, name)

    watching: list[asyncio.Task[None]] = []

    @kopf.on.startup(registry=registry, timeout=TIMEOUT, backoff=BACKOFF)
    async def watch_pods(**_: Any) -> None:
        watching.append(shared.tasks.spawn("pod watch", pod_watch.run()))

    @kopf.on.cleanup(registry=registry, timeout=TIMEOUT, backoff=BACKOFF)
    async def close_clients(**_: Any) -> None:
        for task in watching:  # first: no new passes
            task.cancel()
        await shared.events.drain()
        # What is still running (follow-ups, plans, gate writes) would meet closed clients.
        shared.tasks.cancel_all()
        await shared.agents.close()
        await shared.kube.writer.close()


def _register_workload_indexes(registry: kopf.OperatorRegistry) -> None:
    """The workloads a pass reads (`cache`), kept from watches instead of read per pass."""

    @kopf.index(
        "apps",
        "v1",
        "statefulsets",
        registry=registry,
        id=STATEFULSETS_INDEX,
        timeout=TIMEOUT,
        backoff=BACKOFF,
    )
    async def statefulsets_by_name(
        namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]]:
        return {(_namespaced(namespace), name): slim_workload(body)}

    @kopf.index(
        "apps",
        "v1",
        "deployments",
        registry=registry,
        id=DEPLOYMENTS_INDEX,
        timeout=TIMEOUT,
        backoff=BACKOFF,
    )
    async def deployments_by_name(
        namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]]:
        return {(_namespaced(namespace), name): slim_workload(body)}

    @kopf.index(
        "apps",
        "v1",
        "replicasets",
        registry=registry,
        id=REPLICASETS_INDEX,
        timeout=TIMEOUT,
        backoff=BACKOFF,
    )
    async def replicasets_by_owner(
        namespace: str | None, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]] | None:
        key = pod_key(_namespaced(namespace), body)  # (namespace, controller uid)
        return {key: slim_workload(body)} if key is not None else None

    @kopf.index(
        "apps",
        "v1",
        "replicasets",
        registry=registry,
        id=REPLICASET_OWNERS_INDEX,
        timeout=TIMEOUT,
        backoff=BACKOFF,
    )
    async def replicaset_owners(
        namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]]:
        return {(_namespaced(namespace), name): replicaset_owner(body)}

    # Other projects' workloads (`owners`). A kind whose CRD is not installed is not
    # watched (kopf watches what the cluster serves, and picks up a CRD added later); its
    # index stays unbound and a pass that names one reads it from the API server.
    by_name = (
        ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", LEADERWORKERSETS_INDEX),
        ("jobset.x-k8s.io", "v1alpha2", "jobsets", JOBSETS_INDEX),
        ("batch", "v1", "jobs", JOBS_INDEX),
    )
    for group, version, plural, index in by_name:

        @kopf.index(
            group, version, plural,
            registry=registry, id=index, timeout=TIMEOUT, backoff=BACKOFF,
        )  # fmt: skip
        async def workloads_by_name(
            namespace: str | None, name: str, body: kopf.Body, **_: Any
        ) -> dict[tuple[str, str], dict[str, Any]]:
            return {(_namespaced(namespace), name): slim_workload(body)}

    @kopf.index(
        "batch", "v1", "jobs",
        registry=registry, id=JOBS_BY_OWNER_INDEX, timeout=TIMEOUT, backoff=BACKOFF,
    )  # fmt: skip
    async def jobs_by_owner(
        namespace: str | None, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]] | None:
        key = pod_key(_namespaced(namespace), body)  # (namespace, controller uid)
        return {key: slim_workload(body)} if key is not None else None


def _register_admission(registry: kopf.OperatorRegistry, shared: Shared) -> None:
    """The pod webhook (inject the agent) and the WeightSync webhook (claims)."""
    bind = shared.indexes.bind
    inject, claims = INJECT_AGENT, VALIDATE_CLAIMS  # their configuration: webhook_config

    @kopf.on.mutate(
        inject.version, inject.plural,
        registry=registry, id=inject.id, operations=list(inject.operations),
        labels=inject.labels, ignore_failures=inject.ignore_failures, side_effects=False,
    )  # fmt: skip
    def inject_agent(body: kopf.Body, patch: kopf.Patch, **kwargs: Any) -> None:
        bind(kwargs)
        if not shared.serves(body.metadata.namespace):
            metrics.ADMISSIONS.labels("inject-agent", metrics.AdmissionResult.SKIPPED).inc()
            return
        review.inject(shared.kube, shared.template, body, patch, shared.indexes)

    @kopf.on.validate(
        claims.group, claims.version, claims.plural,
        registry=registry, id=claims.id, operations=list(claims.operations),
        ignore_failures=claims.ignore_failures, side_effects=False,
    )  # fmt: skip
    def validate_claims(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
        bind(kwargs)
        old: kopf.Body | None = kwargs.get("old")  # the stored object, on UPDATE
        if not shared.serves(namespace):
            metrics.ADMISSIONS.labels("validate-claims", metrics.AdmissionResult.ALLOWED).inc()
            return
        try:
            listing = shared.kube.weightsyncs(_namespaced(namespace), shared.indexes)
        except Exception as error:
            metrics.ADMISSIONS.labels("validate-claims", metrics.AdmissionResult.ERROR).inc()
            raise kopf.AdmissionError(
                f"cannot list WeightSyncs to check claims: {error}", code=503
            ) from None
        errors = review.claim_errors(dict(body), dict(old) if old else None, listing)
        errors += review.front_errors(dict(body), shared.template)
        if errors:
            metrics.ADMISSIONS.labels("validate-claims", metrics.AdmissionResult.DENIED).inc()
            # 403, a refusal: 409 would read as a field-manager conflict, and `kubectl
            # apply --server-side` would suggest --force-conflicts, which cannot help.
            raise kopf.AdmissionError("; ".join(errors), code=403)
        metrics.ADMISSIONS.labels("validate-claims", metrics.AdmissionResult.ALLOWED).inc()
