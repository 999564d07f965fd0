"""`helm test`: the webhooks the operator registered answer TLS as the API server expects.

Reads the MutatingWebhookConfiguration and ValidatingWebhookConfiguration that the
operator manages, and for each webhook connects to the endpoint its clientConfig names,
verifying the serving certificate against the clientConfig's caBundle and the endpoint's
host name, exactly as the API server will: a URL's host directly; a Service at its
ClusterIP, read from the API as the API server does (no cluster DNS needed), with the
certificate checked for `<service>.<namespace>.svc`. Then it sends one HTTP request and
expects an HTTP answer. Waits (up to --timeout) for the
operator to register its webhooks after an install.

Standard library only: it runs in the operator image, in the pod the chart's test creates.

    python check_webhooks.py <configuration name> [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
KINDS = ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")
POLL_SECONDS = 2.0
CONNECT_TIMEOUT_SECONDS = 10.0


class CheckFailedError(Exception):
    """One webhook endpoint does not answer as the API server needs it to."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where the API server calls one webhook, and the CA it trusts for it."""

    webhook: str
    host: str
    port: int
    path: str
    ca_pem: str
    service: tuple[str, str] | None = None  # (namespace, name) of a Service webhook
    address: str | None = None  # where to dial, when not `host` (a Service's ClusterIP)

    def __str__(self) -> str:
        via = f" (at {self.address})" if self.address else ""
        return f"{self.webhook} -> https://{self.host}:{self.port}{self.path}{via}"


def endpoints(configuration: dict[str, Any]) -> list[Endpoint]:
    """The endpoint of every webhook in one webhook configuration object."""
    found = []
    for webhook in configuration.get("webhooks") or []:
        name = webhook.get("name", "?")
        config = webhook.get("clientConfig") or {}
        bundle = config.get("caBundle")
        if not bundle:
            raise CheckFailedError(f"{name}: the clientConfig has no caBundle")
        ca_pem = base64.b64decode(bundle).decode()
        if "url" in config:
            parts = urlsplit(config["url"])
            if parts.scheme != "https" or not parts.hostname:
                raise CheckFailedError(f"{name}: clientConfig.url {config['url']!r} is not https")
            found.append(Endpoint(name, parts.hostname, parts.port or 443, parts.path, ca_pem))
        elif "service" in config:
            service = config["service"]
            host = f"{service['name']}.{service['namespace']}.svc"
            port = int(service.get("port", 443))
            found.append(
                Endpoint(
                    name,
                    host,
                    port,
                    service.get("path") or "",
                    ca_pem,
                    service=(service["namespace"], service["name"]),
                )
            )
        else:
            raise CheckFailedError(f"{name}: the clientConfig names neither a url nor a service")
    return found


def check_endpoint(endpoint: Endpoint, timeout: float = CONNECT_TIMEOUT_SECONDS) -> str:
    """TLS to the endpoint, verified like the API server does; return the HTTP status line."""
    context = ssl.create_default_context(cadata=endpoint.ca_pem)
    context.check_hostname = True
    try:
        with (
            socket.create_connection(
                (endpoint.address or endpoint.host, endpoint.port), timeout=timeout
            ) as raw,
            context.wrap_socket(raw, server_hostname=endpoint.host) as tls,
        ):
            request = (
                f"GET {endpoint.path or '/'} HTTP/1.1\r\nHost: {endpoint.host}\r\n"
                "Connection: close\r\n\r\n"
            )
            tls.sendall(request.encode())
            status_line = tls.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    except ssl.SSLCertVerificationError as error:
        raise CheckFailedError(
            f"{endpoint}: certificate not trusted: {error.verify_message}"
        ) from None
    except OSError as error:
        raise CheckFailedError(f"{endpoint}: {error}") from None
    if not status_line.startswith("HTTP/1."):
        raise CheckFailedError(f"{endpoint}: no HTTP answer (got {status_line!r})")
    return status_line


class ApiReader:
    """GETs against the API server with the pod's ServiceAccount token."""

    def __init__(self, account_dir: Path = SERVICE_ACCOUNT_DIR) -> None:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        self.base = f"https://{host}:{port}"
        self.token = (account_dir / "token").read_text().strip()
        self.context = ssl.create_default_context(cafile=str(account_dir / "ca.crt"))

    def webhook_configuration(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.get(f"/apis/admissionregistration.k8s.io/v1/{kind}/{name}", f"{kind}/{name}")

    def cluster_ip(self, namespace: str, name: str) -> str:
        """The ClusterIP of a Service: where the API server sends a Service webhook's calls."""
        what = f"service {namespace}/{name}"
        service = self.get(f"/api/v1/namespaces/{namespace}/services/{name}", what)
        if service is None:
            raise CheckFailedError(f"{what} does not exist")
        address = (service.get("spec") or {}).get("clusterIP")
        if not address or address == "None":
            raise CheckFailedError(f"{what} has no ClusterIP (a headless Service cannot serve)")
        return str(address)

    def get(self, path: str, what: str) -> dict[str, Any] | None:
        """One object, or None if it does not exist."""
        url = f"{self.base}{path}"
        # S310: the URL is https to the API server, built here, never from input.
        headers = {"Authorization": f"Bearer {self.token}"}
        request = urllib.request.Request(url, headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(  # noqa: S310
                request, context=self.context, timeout=CONNECT_TIMEOUT_SECONDS
            ) as reply:
                document: dict[str, Any] = json.load(reply)
                return document
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise CheckFailedError(f"reading {what}: HTTP {error.code} {error.reason}") from None
        except (urllib.error.URLError, OSError) as error:
            raise CheckFailedError(f"reading {what}: {error}") from None


def wait_for_endpoints(reader: ApiReader, name: str, deadline: float) -> list[Endpoint]:
    """Every webhook of both configurations, once the operator has registered some."""
    while True:
        found: list[Endpoint] = []
        missing = []
        for kind in KINDS:
            try:
                configuration = reader.webhook_configuration(kind, name)
            except CheckFailedError as error:
                if time.monotonic() > deadline:
                    raise
                missing.append(str(error))  # the API may be briefly unavailable: retry
                continue
            webhooks = endpoints(configuration) if configuration else []
            if not webhooks:
                missing.append(kind)
            found.extend(webhooks)
        if not missing:
            return found
        if time.monotonic() > deadline:
            raise CheckFailedError(f"no webhooks registered in {', '.join(missing)} {name!r}")
        time.sleep(POLL_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("configuration", help="name of the webhook configurations")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--service-account-dir", type=Path, default=SERVICE_ACCOUNT_DIR)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    try:
        reader = ApiReader(args.service_account_dir)
        found = [
            dataclasses.replace(endpoint, address=reader.cluster_ip(*endpoint.service))
            if endpoint.service
            else endpoint
            for endpoint in wait_for_endpoints(reader, args.configuration, deadline)
        ]
    except CheckFailedError as error:
        print(f"FAIL {error}", file=sys.stderr)
        return 1
    failures = 0
    for endpoint in found:
        # The operator may still be starting its server: retry until the deadline.
        while True:
            try:
                status = check_endpoint(endpoint)
            except CheckFailedError as error:
                if time.monotonic() < deadline:
                    time.sleep(POLL_SECONDS)
                    continue
                print(f"FAIL {error}", file=sys.stderr)
                failures += 1
            else:
                print(f"ok   {endpoint}: TLS verified, {status}")
            break
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
