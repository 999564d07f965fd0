"""The operator's webhooks, written into webhook configurations it may only patch by name.

kopf can manage webhook configurations itself, but it creates them first, whether they
exist or not, and `create` cannot be limited to a name in RBAC: an operator allowed to do
it may create a mutating webhook of any name, which is close to cluster-admin. So the
chart creates the MutatingWebhookConfiguration and the ValidatingWebhookConfiguration
(named `WEBHOOK_CONFIGURATION`, without webhooks), and the operator patches its webhooks
into them by name: at start, whenever its serving certificate changes, and, run alone,
empty again when it exits (a stopped operator then blocks nothing; replicas leave them,
another one serves them). It never creates them: an
operator run outside the chart needs them created first, as the chart does. The patches
go through the operator's one writer (`cluster.apiwriter`), from kopf's webhook server
on the event loop.

`WEBHOOKS` is the one declaration of each webhook: `handlers` registers kopf's handler
with the same id, operations, labels and failure policy, and kopf's server routes a
review by the id at the end of the URL path (`clientConfig`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes.client.exceptions import ApiException

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import names
from weightsync.controller.cluster.apiwriter import JSON_PATCH, ApiWriter, api_path
from weightsync.controller.cluster.kube import NOT_FOUND

log = logging.getLogger(__name__)

Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]

# The patches (through `ApiWriter`), for the chart's RBAC check (tests/unit/chart).
API_CALLS = (
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch"),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "patch"),
)
ADMISSION = ("admissionregistration.k8s.io", "v1")

# How long to wait for the chart's configurations to appear (helm creates them beside
# the operator's Deployment, in no guaranteed order).
_APPEAR_SECONDS = 120.0
_APPEAR_POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Webhook:
    """One admission webhook: what it matches, and whether a failed call lets it pass."""

    kind: Literal["mutating", "validating"]
    id: str  # kopf's handler id, the last segment of the webhook's URL path
    group: str
    version: str
    plural: str
    operations: tuple[Operation, ...]
    ignore_failures: bool
    labels: dict[str, str] | None = None


INJECT_AGENT = Webhook(
    "mutating", "inject-agent", "", "v1", "pods", ("CREATE",), ignore_failures=True,
    labels={names.INJECT_LABEL: names.INJECT_VALUE},
)  # fmt: skip
VALIDATE_CLAIMS = Webhook(
    "validating", "validate-claims", GROUP, VERSION, PLURAL,
    ("CREATE", "UPDATE"), ignore_failures=False,
)  # fmt: skip
WEBHOOKS = (INJECT_AGENT, VALIDATE_CLAIMS)


def webhook_entry(webhook: Webhook, client_config: dict[str, Any], suffix: str) -> dict[str, Any]:
    """The configuration's entry for `webhook`, served at `client_config` (URL or
    Service, with the CA bundle) plus its id."""
    config = copy.deepcopy(client_config)
    path = "/" + urllib.parse.quote(webhook.id)
    if "url" in config:
        config["url"] = config["url"].rstrip("/") + path
    if "service" in config:
        config["service"]["path"] = config["service"].get("path", "") + path
    entry: dict[str, Any] = {
        "name": f"{webhook.id}.{suffix}",
        "sideEffects": "None",
        "failurePolicy": "Ignore" if webhook.ignore_failures else "Fail",
        "matchPolicy": "Equivalent",
        "rules": [
            {
                "apiGroups": [webhook.group],
                "apiVersions": [webhook.version],
                "resources": [webhook.plural],
                "operations": list(webhook.operations),
                "scope": "*",
            }
        ],
        "clientConfig": config,
        "timeoutSeconds": 30,
        "admissionReviewVersions": ["v1"],
    }
    if webhook.labels:
        entry["objectSelector"] = {
            "matchExpressions": [
                {"key": k, "operator": "In", "values": [v]} for k, v in webhook.labels.items()
            ]
        }
    return entry


def entries(client_config: dict[str, Any] | None, suffix: str) -> dict[str, list[dict[str, Any]]]:
    """Each configuration kind's webhooks; none when `client_config` is None (exiting)."""
    out: dict[str, list[dict[str, Any]]] = {"mutating": [], "validating": []}
    if client_config is not None:
        for webhook in WEBHOOKS:
            out[webhook.kind].append(webhook_entry(webhook, client_config, suffix))
    return out


class Configurations:
    """Patches the operator's webhooks into the two configurations named `name`."""

    def __init__(self, writer: ApiWriter, name: str) -> None:
        self._writer = writer
        self.name = name

    async def apply(self, client_config: dict[str, Any] | None) -> None:
        """Write the webhooks served at `client_config` (None: remove them)."""
        for kind, webhooks in entries(client_config, self.name).items():
            await self._apply_one(kind, webhooks, wait=client_config is not None)
        log.info(
            "webhook configurations %s: %s",
            self.name,
            "webhooks written" if client_config is not None else "webhooks removed",
        )

    async def _apply_one(self, kind: str, webhooks: list[dict[str, Any]], *, wait: bool) -> None:
        plural = f"{kind}webhookconfigurations"
        path = api_path(*ADMISSION, plural, name=self.name)
        body = [{"op": "add", "path": "/webhooks", "value": webhooks}]  # add replaces
        deadline = time.monotonic() + (_APPEAR_SECONDS if wait else 0.0)
        while True:
            try:
                await self._writer.patch(path, body, resource=plural, content_type=JSON_PATCH)
            except ApiException as error:
                if error.status != NOT_FOUND:
                    raise
            else:
                return
            if not webhooks:
                return  # nothing to remove from a configuration that is gone
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the {kind} webhook configuration {self.name!r} does not exist: the"
                    " chart creates it (an operator run outside the chart needs it created"
                    " first, without webhooks)"
                )
            log.info("waiting for the %s webhook configuration %s", kind, self.name)
            await asyncio.sleep(_APPEAR_POLL_SECONDS)
