"""`helm uninstall`'s pre-delete hook: leave a cluster that works without the operator.

Run as the operator's own ServiceAccount before Helm removes it and its rights:

1. stop the operator (scale its Deployment to 0 and wait), so nothing re-registers a
   webhook or re-adds a finalizer behind this hook;
2. delete the webhook configurations it registered: `validate-claims` fails closed, and
   with nothing behind it every later `kubectl apply` of a WeightSync would be refused;
3. for every WeightSync: open its pods' readiness gates (as deleting it would) and remove
   the operator's finalizer, so deleting WeightSyncs or the CRD later does not hang; and
   remove it again while the operator's pod may still be terminating (its grace period);
4. delete a `helm test` pod that failed (its hook policy keeps failed ones).

The CRD and the WeightSyncs stay, as docs/install.md says. Reads go through the official
client (in threads), writes through the operator's one writer (`cluster.apiwriter`), all
on one event loop that `main` runs.

    python -m weightsync.controller.uninstall --operator-namespace weightsync-system \\
        --deployment weightsync --webhook-configuration weightsync.io [--namespace team-a ...]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import names
from weightsync.controller.cluster import pod_actions
from weightsync.controller.cluster.apiwriter import MERGE_PATCH, STRATEGIC_MERGE_PATCH, api_path
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.cluster.kube import Kube, load_config

log = logging.getLogger("weightsync.uninstall")

# The writes below (through `Kube.writer`), for the chart's RBAC check (tests/unit/chart).
API_CALLS = (
    ("apps", "deployments/scale", "patch"),
    ("", "pods", "delete"),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "delete"),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "delete"),
    ("weightsync.io", "weightsyncs", "patch"),
)
NOT_FOUND = 404
STOP_TIMEOUT_SECONDS = 60.0
# After its grace period the kubelet kills the operator; a little more for the kill.
SIGKILL_MARGIN_SECONDS = 5.0
RECHECK_SECONDS = 1.0


async def stop_operator(kube: Kube, namespace: str, deployment: str) -> None:
    path = api_path("apps", "v1", "deployments", namespace=namespace, name=deployment, sub="scale")
    try:
        await kube.writer.patch(
            path, {"spec": {"replicas": 0}}, resource="deployments/scale",
            content_type=STRATEGIC_MERGE_PATCH,
        )  # fmt: skip
    except ApiException as error:
        if error.status == NOT_FOUND:
            return
        raise
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        read = kube.apps.read_namespaced_deployment
        status = (await asyncio.to_thread(read, deployment, namespace)).status
        if status is None or not (status.replicas or 0):
            log.info("operator %s/%s stopped", namespace, deployment)
            return
        await asyncio.sleep(1.0)
    raise TimeoutError(
        f"operator {namespace}/{deployment} still running after {STOP_TIMEOUT_SECONDS} s"
    )


async def delete_test_pod(kube: Kube, namespace: str, name: str) -> None:
    """A failed `helm test` pod (hook policy keeps it) would outlive the release."""
    try:
        await kube.writer.delete(api_path("", "v1", "pods", namespace=namespace, name=name),
                                 resource="pods")  # fmt: skip
    except ApiException as error:
        if error.status != NOT_FOUND:
            raise


async def delete_webhooks(kube: Kube, configuration: str) -> None:
    for plural in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        path = api_path("admissionregistration.k8s.io", "v1", plural, name=configuration)
        try:
            await kube.writer.delete(path, resource=plural)
        except ApiException as error:
            if error.status != NOT_FOUND:
                raise
    log.info("deleted webhook configurations %s", configuration)


def weightsyncs(kube: Kube, namespaces: list[str]) -> list[dict[str, Any]]:
    """Blocks (the official client's reads)."""
    if namespaces:
        return [s for ns in namespaces for s in kube.list_weightsyncs(ns)]
    listing: dict[str, Any] = kube.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)  # type: ignore[assignment]
    return list(listing.get("items") or [])


async def let_go(kube: Kube, sync: dict[str, Any]) -> None:
    """Open the WeightSync's gates and drop the operator's finalizer (nothing else)."""
    meta = sync["metadata"]
    # No watches here: the pods are listed.
    await pod_actions.release(kube, meta["namespace"], sync, Indexes())
    await drop_finalizer(kube, sync)
    log.info("released WeightSync %s/%s", meta["namespace"], meta["name"])


async def drop_finalizer(kube: Kube, sync: dict[str, Any]) -> bool:
    """Remove the operator's finalizer if `sync` has it; whether it had."""
    meta = sync["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    if names.FINALIZER not in finalizers:
        return False
    kept = [f for f in finalizers if f != names.FINALIZER]
    patch = {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}}
    path = api_path(GROUP, VERSION, PLURAL, namespace=meta["namespace"], name=meta["name"])
    await kube.writer.patch(path, patch, resource="weightsyncs", content_type=MERGE_PATCH)
    return True


async def uninstall(kube: Kube, args: argparse.Namespace) -> None:
    # A Deployment scaled to 0 counts no terminating pod: the operator may still be
    # handling events for its grace period, and the update that drops a finalizer is one
    # (kopf adds its finalizer back). Only after that period is it gone for sure, so the
    # finalizers are dropped again until then (a demo's WeightSync kept one: CI, 2026-11-28).
    gone_by = time.monotonic() + args.operator_grace_seconds + SIGKILL_MARGIN_SECONDS
    await stop_operator(kube, args.operator_namespace, args.deployment)
    if args.test_pod:
        await delete_test_pod(kube, args.operator_namespace, args.test_pod)
    await delete_webhooks(kube, args.webhook_configuration)
    for sync in await asyncio.to_thread(weightsyncs, kube, args.namespace):
        await let_go(kube, sync)
    while time.monotonic() < gone_by:
        await asyncio.sleep(RECHECK_SECONDS)
        for sync in await asyncio.to_thread(weightsyncs, kube, args.namespace):
            if await drop_finalizer(kube, sync):
                meta = sync["metadata"]
                log.info("dropped a finalizer added back to %s/%s", meta["namespace"], meta["name"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--operator-namespace", required=True)
    parser.add_argument("--deployment", required=True, help="the operator's Deployment")
    parser.add_argument("--webhook-configuration", required=True)
    parser.add_argument("--namespace", action="append", default=[], help="watched namespaces")
    parser.add_argument("--test-pod", default="", help="a failed `helm test` pod to delete")
    parser.add_argument(
        "--operator-grace-seconds", type=float, default=30.0,
        help="the operator pod's terminationGracePeriodSeconds",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    kube = Kube(load_config())
    kube.writer.run_blocking(uninstall(kube, args))


if __name__ == "__main__":
    main()
