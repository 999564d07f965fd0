"""Every call the operator makes to the API server, through the official (synchronous) client.

These functions block: async code calls them with `asyncio.to_thread`. Objects come
back as plain dicts in the API server's JSON shape, so the pure modules never see the
client's model classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import names
from weightsync.controller.workloads import World

NOT_FOUND = 404
CONFLICT = 409


def load_config() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG)."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


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


class Kube:
    """The API calls of the reconcile and the webhook."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def _plain(self, obj: object) -> dict[str, Any]:
        result: dict[str, Any] = self.api.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return result

    # -- WeightSyncs ---------------------------------------------------------------

    def get_weightsync(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self.custom.get_namespaced_custom_object(  # type: ignore[assignment]
                GROUP, VERSION, namespace, PLURAL, name
            )
        except ApiException as error:
            if error.status == NOT_FOUND:
                return None
            raise
        return obj

    def list_weightsyncs(self, namespace: str) -> list[dict[str, Any]]:
        listing: dict[str, Any] = self.custom.list_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, namespace, PLURAL
        )
        return list(listing.get("items") or [])

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the status (a JSON merge patch replaces lists whole)."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}
        )

    # -- workloads -----------------------------------------------------------------

    def _read(self, read: Any, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return self._plain(read(name, namespace))
        except ApiException as error:
            if error.status == NOT_FOUND:
                return None
            raise

    def observe(self, namespace: str, trainer: str, deployments: list[str]) -> World:
        """The trainer StatefulSet, the Deployments, their ReplicaSets and their pods."""
        statefulset = self._read(self.apps.read_namespaced_stateful_set, trainer, namespace)
        found = {
            name: self._read(self.apps.read_namespaced_deployment, name, namespace)
            for name in deployments
        }
        replicasets: dict[str, dict[str, Any]] = {}
        pods: dict[str, dict[str, Any]] = {}
        for name, deployment in found.items():
            if deployment is None:
                continue
            selector = selector_string(deployment["spec"].get("selector"))
            for rs in self.apps.list_namespaced_replica_set(
                namespace, label_selector=selector
            ).items:
                plain = self._plain(rs)
                replicasets[plain["metadata"]["uid"]] = plain
            self._add_pods(pods, namespace, selector)
            del name
        if statefulset is not None:
            self._add_pods(pods, namespace, selector_string(statefulset["spec"].get("selector")))
        return World(statefulset, found, list(replicasets.values()), list(pods.values()))

    def _add_pods(self, into: dict[str, dict[str, Any]], namespace: str, selector: str) -> None:
        for pod in self.core.list_namespaced_pod(namespace, label_selector=selector).items:
            plain = self._plain(pod)
            into[plain["metadata"]["uid"]] = plain

    def replicaset_owner(self, namespace: str, name: str) -> str | None:
        """The Deployment that controls ReplicaSet `name`, if any (for the webhook)."""
        rs = self._read(self.apps.read_namespaced_replica_set, name, namespace)
        for ref in (rs or {}).get("metadata", {}).get("ownerReferences") or []:
            if ref.get("controller") and ref.get("kind") == "Deployment":
                return str(ref["name"])
        return None

    # -- the agents' token ---------------------------------------------------------

    FIELD_MANAGER = "weightsync-operator"

    def apply_token(self, namespace: str, sync: Mapping[str, Any], token: str) -> None:
        """Write the WeightSync's agent token Secret (owned by the WeightSync) by server-side
        apply: idempotent, and never read back (`controller.tokens`)."""
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
        self.core.patch_namespaced_secret(
            name,
            namespace,
            body,
            field_manager=self.FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    # -- pods ----------------------------------------------------------------------

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Delete exactly this pod (a UID precondition spares a same-named replacement)."""
        try:
            self.core.delete_namespaced_pod(
                name,
                namespace,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            )
        except ApiException as error:
            if error.status not in (NOT_FOUND, CONFLICT):
                raise

    def set_pod_condition(
        self,
        namespace: str,
        pod: str,
        *,
        kind: str,
        status: str,
        reason: str,
        message: str,
        since: str,
    ) -> None:
        """Set one pod condition (a strategic merge keyed by type leaves the others)."""
        condition = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
            "lastProbeTime": None,
        }
        try:
            self.core.patch_namespaced_pod_status(
                pod, namespace, {"status": {"conditions": [condition]}}
            )
        except ApiException as error:
            if error.status != NOT_FOUND:  # the pod went away meanwhile: nothing to gate
                raise


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
