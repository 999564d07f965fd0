"""The agents' control-API token: derived, never stored state the operator must read back.

Each WeightSync's token is an HMAC of its namespace and name under one operator-wide key
(a Secret in the operator's own namespace, created once). So a WeightSync deleted and
created again gets the token its running agents already hold (no window of 401s), an
operator restarted with the same key agrees with every agent at once, and the operator
needs no right to read Secrets outside its namespace: it writes each WeightSync's token
Secret (created, or replaced whole) and never reads it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets

from kubernetes.client.exceptions import ApiException

from weightsync.controller.cluster.apiwriter import api_path
from weightsync.controller.cluster.kube import Kube

log = logging.getLogger(__name__)

# The key's write (through `Kube.writer`), for the chart's RBAC check (tests/unit/chart).
API_CALLS = (("", "secrets", "create"),)
KEY_FIELD = "key"
KEY_BYTES = 32
NOT_FOUND, CONFLICT = 404, 409


def derive(key: bytes, namespace: str, weightsync: str) -> str:
    """The bearer token of one WeightSync's agents (URL-safe, 43 characters)."""
    digest = hmac.new(key, f"{namespace}/{weightsync}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


async def load_key(kube: Kube, namespace: str, name: str) -> bytes:
    """The operator-wide key from Secret `namespace/name`, created with a random key once
    (read through the official client, written through `kube.writer`)."""
    try:
        secret = await asyncio.to_thread(kube.core.read_namespaced_secret, name, namespace)
    except ApiException as error:
        if error.status != NOT_FOUND:
            raise
    else:
        stored = (secret.data or {}).get(KEY_FIELD)
        if not stored:
            raise RuntimeError(f"Secret {namespace}/{name} has no {KEY_FIELD!r}")
        return base64.b64decode(stored)
    key = secrets.token_bytes(KEY_BYTES)
    body = {
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "weightsync-operator"},
        },
        "type": "Opaque",
        "data": {KEY_FIELD: base64.b64encode(key).decode()},
    }
    try:
        await kube.writer.create(
            api_path("", "v1", "secrets", namespace=namespace), body, resource="secrets"
        )
    except ApiException as error:
        if error.status != CONFLICT:
            raise
        return await load_key(kube, namespace, name)  # another replica created it first
    log.info("created the agent token key in Secret %s/%s", namespace, name)
    return key
