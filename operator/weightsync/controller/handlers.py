"""kopf registrations. Thin: each handler calls the reconciler or an admission function.

* create / update / resume -> one reconcile pass (`reconcile.Reconciler.run`); a missing
  workload is a slow `TemporaryError`, a spec the operator cannot act on a
  `PermanentError` (its status already says why, with a Warning Event).
* a timer per WeightSync -> the same pass, for drift and for polling the agents.
* pod events (labelled pods only: the watch itself is filtered server-side) -> a pass
  for the WeightSync that selects the pod (all of the namespace's if it carries no
  sync label yet); passes coalesce (`scheduling`), so a burst costs one or two.
* delete -> open the readiness gates the WeightSync held (the finalizer's job).
* admission -> `admission.inject` and `admission.claim_errors`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import admission, metrics, names
from weightsync.controller import pods as pod_actions
from weightsync.controller.agents import AgentClient
from weightsync.controller.injection import AgentTemplate
from weightsync.controller.kube import Kube
from weightsync.controller.reconcile import Outcome, Reconciler, Result, log_pass_failure
from weightsync.controller.settings import OperatorSettings

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the handlers share; built once in `main`."""

    settings: OperatorSettings
    kube: Kube
    agents: AgentClient
    reconciler: Reconciler
    template: AgentTemplate
    namespaces: tuple[str, ...] = ()  # served namespaces; empty: the whole cluster

    def serves(self, namespace: str | None) -> bool:
        """kopf registers webhooks cluster-wide (no namespaceSelector); an operator that
        serves some namespaces leaves admission in the others alone."""
        return not self.namespaces or namespace in self.namespaces


def _raise_for(result: Result, retry_seconds: float) -> None:
    if result.outcome in (Outcome.OK, Outcome.GONE):
        return
    if result.outcome is Outcome.WAITING:
        raise kopf.TemporaryError(result.message, delay=retry_seconds)
    raise kopf.PermanentError(result.message)


def _namespaced(namespace: str | None) -> str:
    # WeightSyncs and pods are namespaced; kopf types the field for cluster-scoped kinds too.
    if not namespace:
        raise kopf.PermanentError("a namespaced object arrived without a namespace")
    return namespace


def register(registry: kopf.OperatorRegistry, runtime: Runtime) -> None:
    """Register every handler on `registry` (no module-level registration)."""
    settings = runtime.settings
    reconciler = runtime.reconciler
    resource = (GROUP, VERSION, PLURAL)

    # kopf's default login handlers live on its default registry; ours needs its own.
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info: kopf.ConnectionInfo | None = kopf.login_via_client(**kwargs)
        return info

    @kopf.on.create(*resource, registry=registry, id="reconcile")
    @kopf.on.update(*resource, registry=registry, id="reconcile")
    @kopf.on.resume(*resource, registry=registry, id="reconcile")
    async def reconcile(namespace: str | None, name: str, **_: Any) -> None:
        result = await reconciler.run(_namespaced(namespace), name)
        _raise_for(result, settings.missing_reference_retry_seconds)

    @kopf.timer(*resource, registry=registry, id="resync", interval=settings.resync_seconds)
    async def resync(namespace: str | None, name: str, **_: Any) -> None:
        # Errors are the next tick's business: a timer must not back off for minutes.
        try:
            await reconciler.run(_namespaced(namespace), name)
        except Exception as error:
            log_pass_failure(f"resync of {namespace}/{name}", error)

    @kopf.index(*resource, registry=registry)
    def weightsyncs_by_namespace(namespace: str | None, name: str, **_: Any) -> dict[str, str]:
        return {_namespaced(namespace): name}

    @kopf.on.event("v1", "pods", registry=registry, labels={names.INJECT_LABEL: names.INJECT_VALUE})
    async def pod_changed(
        body: kopf.Body,
        namespace: str | None,
        weightsyncs_by_namespace: kopf.Index[str, str] | None = None,
        **_: Any,
    ) -> None:
        namespace = _namespaced(namespace)
        label = (body.metadata.labels or {}).get(names.SYNC_LABEL)
        if label:
            await pod_actions.close_gate_if_restarting(runtime.kube, namespace, body)
        index: Mapping[str, Collection[str]] = weightsyncs_by_namespace or {}
        known = list(index.get(namespace, []))
        # The label is the WeightSync's name or, for a long name, a hash of it.
        targets = [n for n in known if names.sync_label(n) == label] or known
        results = await asyncio.gather(
            *(reconciler.run(namespace, target) for target in targets), return_exceptions=True
        )
        for target, outcome in zip(targets, results, strict=True):
            if isinstance(outcome, Exception):
                log.warning(
                    "pass for %s/%s after a pod event failed: %s", namespace, target, outcome
                )

    @kopf.on.delete(*resource, registry=registry, id="release")
    async def release(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> None:
        namespace = _namespaced(namespace)
        await reconciler.release(namespace, dict(body))
        log.info("released the pods of %s/%s", namespace, name)

    @kopf.on.mutate(
        "v1", "pods",
        registry=registry, id="inject-agent", operations=["CREATE"],
        labels={names.INJECT_LABEL: names.INJECT_VALUE},
        ignore_failures=True, persistent=False, side_effects=False,
    )  # fmt: skip
    def inject_agent(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        if not runtime.serves(body.metadata.namespace):
            metrics.ADMISSIONS.labels("inject-agent", "skipped").inc()
            return
        admission.inject(runtime.kube, runtime.template, body, patch)

    @kopf.on.validate(
        *resource,
        registry=registry, id="validate-claims", operations=["CREATE", "UPDATE"],
        ignore_failures=False, persistent=False, side_effects=False,
    )  # fmt: skip
    def validate_claims(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
        old: kopf.Body | None = kwargs.get("old")  # the stored object, on UPDATE
        if not runtime.serves(namespace):
            metrics.ADMISSIONS.labels("validate-claims", "allowed").inc()
            return
        try:
            listing = runtime.kube.list_weightsyncs(_namespaced(namespace))
        except Exception as error:
            metrics.ADMISSIONS.labels("validate-claims", "error").inc()
            raise kopf.AdmissionError(
                f"cannot list WeightSyncs to check claims: {error}", code=503
            ) from None
        errors = admission.claim_errors(dict(body), dict(old) if old else None, listing)
        if errors:
            metrics.ADMISSIONS.labels("validate-claims", "denied").inc()
            raise kopf.AdmissionError("; ".join(errors), code=409)
        metrics.ADMISSIONS.labels("validate-claims", "allowed").inc()

    @kopf.on.cleanup(registry=registry)
    async def close_clients(**_: Any) -> None:
        await runtime.agents.close()
