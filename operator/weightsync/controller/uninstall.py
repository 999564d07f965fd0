"""`helm uninstall`'s pre-delete hook: leave a cluster that works without the operator.

Run as the operator's own ServiceAccount before Helm removes it and its rights:

1. stop the operator (scale its Deployment to 0 and wait), so nothing re-registers a
   webhook or re-adds a finalizer behind this hook;
2. delete the webhook configurations it registered: `validate-claims` fails closed, and
   with nothing behind it every later `kubectl apply` of a WeightSync would be refused;
3. for every WeightSync: open its pods' readiness gates (as deleting it would) and remove
   the operator's finalizer, so deleting WeightSyncs or the CRD later does not hang;
4. delete a `helm test` pod that failed (its hook policy keeps failed ones).

The CRD and the WeightSyncs stay, as docs/install.md says.

    python -m weightsync.controller.uninstall --operator-namespace weightsync-system \\
        --deployment weightsync --webhook-configuration weightsync.io [--namespace team-a ...]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import names
from weightsync.controller.cluster import pods as pod_actions
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.cluster.kube import Kube, load_config

log = logging.getLogger("weightsync.uninstall")

NOT_FOUND = 404
STOP_TIMEOUT_SECONDS = 60.0


def stop_operator(kube: Kube, namespace: str, deployment: str) -> None:
    try:
        kube.apps.patch_namespaced_deployment_scale(
            deployment, namespace, {"spec": {"replicas": 0}}
        )
    except ApiException as error:
        if error.status == NOT_FOUND:
            return
        raise
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        status = kube.apps.read_namespaced_deployment(deployment, namespace).status
        if status is None or not (status.replicas or 0):
            log.info("operator %s/%s stopped", namespace, deployment)
            return
        time.sleep(1.0)
    raise TimeoutError(
        f"operator {namespace}/{deployment} still running after {STOP_TIMEOUT_SECONDS} s"
    )


def delete_test_pod(kube: Kube, namespace: str, name: str) -> None:
    """A failed `helm test` pod (hook policy keeps it) would outlive the release."""
    try:
        kube.core.delete_namespaced_pod(name, namespace)
    except ApiException as error:
        if error.status != NOT_FOUND:
            raise


def delete_webhooks(kube: Kube, configuration: str) -> None:
    admission = client.AdmissionregistrationV1Api(kube.api)
    for delete in (
        admission.delete_mutating_webhook_configuration,
        admission.delete_validating_webhook_configuration,
    ):
        try:
            delete(configuration)
        except ApiException as error:
            if error.status != NOT_FOUND:
                raise
    log.info("deleted webhook configurations %s", configuration)


def weightsyncs(kube: Kube, namespaces: list[str]) -> list[dict[str, Any]]:
    if namespaces:
        return [s for ns in namespaces for s in kube.list_weightsyncs(ns)]
    listing: dict[str, Any] = kube.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)  # type: ignore[assignment]
    return list(listing.get("items") or [])


def let_go(kube: Kube, sync: dict[str, Any]) -> None:
    """Open the WeightSync's gates and drop the operator's finalizer (nothing else)."""
    meta = sync["metadata"]
    namespace, name = meta["namespace"], meta["name"]

    async def release() -> None:
        try:  # no watches here: the pods are listed
            await pod_actions.release(kube, namespace, sync, Indexes())
        finally:
            await kube.writer.close()  # its session belongs to this loop

    asyncio.run(release())
    finalizers = list(meta.get("finalizers") or [])
    if names.FINALIZER in finalizers:
        kept = [f for f in finalizers if f != names.FINALIZER]
        patch = {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}}
        kube.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch)
    log.info("released WeightSync %s/%s", namespace, name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--operator-namespace", required=True)
    parser.add_argument("--deployment", required=True, help="the operator's Deployment")
    parser.add_argument("--webhook-configuration", required=True)
    parser.add_argument("--namespace", action="append", default=[], help="watched namespaces")
    parser.add_argument("--test-pod", default="", help="a failed `helm test` pod to delete")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    kube = Kube(load_config())
    stop_operator(kube, args.operator_namespace, args.deployment)
    if args.test_pod:
        delete_test_pod(kube, args.operator_namespace, args.test_pod)
    delete_webhooks(kube, args.webhook_configuration)
    for sync in weightsyncs(kube, args.namespace):
        let_go(kube, sync)


if __name__ == "__main__":
    main()
