"""The HTTPS server kopf serves admission reviews on, and its certificates.

kopf's `WebhookServer` serves TLS and yields the `clientConfig` that goes into the webhook
configurations (`webhook_config` writes them). It derives the URL from its listening address;
this subclass replaces that with what the API server must really call: the configured
`WEBHOOK_URL` (URL mode: local control planes, the demo, an operator outside the
cluster), or a `service` reference (Service mode: real clusters). The caBundle is
kopf's, i.e. the CA of whichever certificates the server was given. The managed
certificates' Secret is read through the official client and written through the
operator's one writer (`cluster.apiwriter`); `main` runs `build_server` before kopf's loop
starts, on a loop of its own (`ApiWriter.run_blocking`).
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from weightsync.controller.admission import certs
from weightsync.controller.admission.webhook_config import Configurations
from weightsync.controller.cluster.apiwriter import api_path
from weightsync.controller.cluster.kube import CONFLICT, NOT_FOUND, Kube
from weightsync.controller.settings import CertMode, OperatorSettings

log = logging.getLogger(__name__)

# The certificates' writes (through `Kube.writer`), for the chart's RBAC check.
API_CALLS = (("", "secrets", "create"), ("", "secrets", "update"))


class WeightsyncWebhookServer(kopf.WebhookServer):
    """kopf's server with the client config the API server needs (URL or Service),
    written into the webhook configurations by `configurations` (kopf manages none)."""

    def __init__(
        self,
        *,
        client_config: dict[str, Any],
        configurations: Configurations,
        remove_on_exit: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._client_config = client_config
        self._configurations = configurations
        # With replicas (leader election) another one still serves: the webhooks stay.
        self._remove_on_exit = remove_on_exit

    async def __call__(self, fn: Any) -> AsyncIterator[kopf.WebhookClientConfig]:
        written = False
        try:
            async for config in super().__call__(fn):
                rewritten: kopf.WebhookClientConfig = copy.deepcopy(self._client_config)  # type: ignore[assignment]
                if "caBundle" in config:
                    rewritten["caBundle"] = config["caBundle"]
                await self._configurations.apply(dict(rewritten))
                written = True
                yield rewritten
        finally:
            if written and self._remove_on_exit:  # a stopped operator blocks nothing
                try:
                    await self._configurations.apply(None)
                except Exception as error:  # exiting anyway: say so, do not mask the cause
                    log.warning("could not remove the webhooks on exit: %s", error)


def client_config(settings: OperatorSettings) -> dict[str, Any]:
    if settings.webhook_url is not None:
        return {"url": settings.webhook_url.rstrip("/")}
    return {
        "service": {
            "name": settings.webhook_service_name,
            "namespace": settings.service_namespace,
            "port": settings.webhook_service_port,
            "path": "",
        }
    }


def serving_hosts(settings: OperatorSettings) -> list[str]:
    """Names the serving certificate must cover."""
    if settings.webhook_url is not None:
        return [settings.webhook_host]
    name = settings.webhook_service_name or ""
    return certs.dns_names_for_service(name, settings.service_namespace)


async def managed_bundle(kube: Kube, settings: OperatorSettings) -> certs.TlsBundle:
    """The stored certificates if still good for our hosts, else new ones (stored first)."""
    hosts = serving_hosts(settings)
    namespace, name = settings.namespace, settings.webhook_cert_secret
    try:
        secret = await asyncio.to_thread(kube.core.read_namespaced_secret, name, namespace)
    except ApiException as error:
        if error.status != NOT_FOUND:
            raise
        secret = None
    if secret is not None:
        stored = certs.TlsBundle.from_secret_data(
            {key: str(value) for key, value in (secret.data or {}).items()}
        )
        if stored is not None and certs.usable(stored, hosts):
            log.info("reusing the webhook certificates in Secret %s/%s", namespace, name)
            return stored
    bundle = certs.generate(hosts)
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {"app.kubernetes.io/managed-by": "weightsync-operator"},
    }
    body = {"metadata": metadata, "type": "kubernetes.io/tls", "data": bundle.to_secret_data()}
    stored_secrets = api_path("", "v1", "secrets", namespace=namespace)
    if secret is None:
        try:
            await kube.writer.create(stored_secrets, body, resource="secrets")
        except ApiException as error:
            if error.status != CONFLICT:
                raise
            return await managed_bundle(kube, settings)  # another replica stored one first
    else:
        # Replace only the version we read: a concurrent writer makes this fail loudly.
        if secret.metadata is not None and secret.metadata.resource_version is not None:
            metadata["resourceVersion"] = secret.metadata.resource_version
        await kube.writer.replace(f"{stored_secrets}/{name}", body, resource="secrets")
    log.info("generated webhook certificates for %s into Secret %s/%s", hosts, namespace, name)
    return bundle


async def build_server(
    kube: Kube, settings: OperatorSettings, configurations: Configurations
) -> WeightsyncWebhookServer:
    """The webhook server with certificates per `WEBHOOK_CERTS` (managed: API calls)."""
    if settings.webhook_certs is CertMode.DIRECTORY:
        directory = settings.webhook_cert_dir or Path()
        paths = directory / certs.CERT_FILE, directory / certs.KEY_FILE, directory / certs.CA_FILE
    else:
        bundle = await managed_bundle(kube, settings)
        # The key lives in the operator's memory-backed temp dir for the process' life,
        # and goes with it (an operator run outside a pod leaves no key behind).
        directory = Path(tempfile.mkdtemp(prefix="weightsync-webhook-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        paths = bundle.write(directory)
    return WeightsyncWebhookServer(
        client_config=client_config(settings),
        configurations=configurations,
        remove_on_exit=not settings.leader_lease,
        addr=settings.webhook_listen_host,
        port=settings.webhook_listen_port,
        certfile=paths[0],
        pkeyfile=paths[1],
        cafile=paths[2],
        # Directory mode: cert-manager renews the files in place; re-read them this often.
        file_check_interval=60.0,
    )
