"""The `helm test` check (charts/weightsync/files/check_webhooks.py) against real TLS servers.

A local HTTPS server plays the API server (serving webhook configurations to a bearer
token) and the webhook; certificates come from a throwaway CA made with `cryptography`.
"""

from __future__ import annotations

import base64
import datetime
import importlib.util
import ipaddress
import json
import ssl
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.unit.chart.helm import CHART

TOKEN = "test-token"
API_PREFIX = "/apis/admissionregistration.k8s.io/v1/"
SERVICES_PREFIX = "/api/v1/namespaces/"


def load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_webhooks", CHART / "files" / "check_webhooks.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check = load_check()


@dataclass
class Pki:
    ca_pem: str
    cert_file: Path
    key_file: Path


def make_pki(directory: Path, name: str, hosts: list[str]) -> Pki:
    """A CA and a serving certificate for `hosts` (DNS names or IP addresses)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Pki(ca.public_bytes(serialization.Encoding.PEM).decode(), cert_file, key_file)


class Handler(BaseHTTPRequestHandler):
    configurations: ClassVar[dict[str, dict[str, Any]]] = {}
    services: ClassVar[dict[str, dict[str, Any]]] = {}  # "<namespace>/services/<name>"

    def do_GET(self) -> None:
        if self.path.startswith((API_PREFIX, SERVICES_PREFIX)):
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.send_error(401)
                return
            body = self.configurations.get(self.path.removeprefix(API_PREFIX))
            if self.path.startswith(SERVICES_PREFIX):
                body = self.services.get(self.path.removeprefix(SERVICES_PREFIX))
            if body is None:
                self.send_error(404)
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_error(405)  # like kopf's server for a GET on a webhook path

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, Pki]]:
    pki = make_pki(tmp_path, "server", ["127.0.0.1", "webhook.example", "ws-webhook.ops.svc"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.cert_file, pki.key_file)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], pki
    finally:
        server.shutdown()
        server.server_close()
        Handler.configurations = {}
        Handler.services = {}


def bundle(pem: str) -> str:
    return base64.b64encode(pem.encode()).decode()


def configuration(name: str, client_config: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "webhooks": [{"name": name, "clientConfig": client_config}]}


def test_endpoints_of_url_and_service_webhooks() -> None:
    ca = bundle("CA PEM")
    found = check.endpoints(
        {
            "webhooks": [
                {
                    "name": "a",
                    "clientConfig": {"url": "https://10.0.0.5:9443/mutate", "caBundle": ca},
                },
                {
                    "name": "b",
                    "clientConfig": {
                        "service": {"name": "ws-webhook", "namespace": "ops", "path": "/validate"},
                        "caBundle": ca,
                    },
                },
            ]
        }
    )
    assert [(e.webhook, e.host, e.port, e.path, e.ca_pem) for e in found] == [
        ("a", "10.0.0.5", 9443, "/mutate", "CA PEM"),
        ("b", "ws-webhook.ops.svc", 443, "/validate", "CA PEM"),
    ]


@pytest.mark.parametrize(
    ("client_config", "message"),
    [
        ({"url": "https://10.0.0.5:9443"}, "no caBundle"),
        ({"url": "http://10.0.0.5:9443", "caBundle": bundle("x")}, "is not https"),
        ({"caBundle": bundle("x")}, "neither a url nor a service"),
    ],
)
def test_endpoints_refuse_what_the_api_server_could_not_call(
    client_config: dict[str, Any], message: str
) -> None:
    with pytest.raises(check.CheckFailedError, match=message):
        check.endpoints(configuration("w", client_config))


def test_a_trusted_certificate_for_the_host_passes(tls_server: tuple[int, Pki]) -> None:
    port, pki = tls_server
    status = check.check_endpoint(check.Endpoint("w", "127.0.0.1", port, "/mutate", pki.ca_pem))
    assert status.startswith("HTTP/1.")
    assert "405" in status


def test_a_certificate_from_another_ca_fails(tls_server: tuple[int, Pki], tmp_path: Path) -> None:
    port, _ = tls_server
    other = make_pki(tmp_path, "other", ["127.0.0.1"])
    with pytest.raises(check.CheckFailedError, match="certificate not trusted"):
        check.check_endpoint(check.Endpoint("w", "127.0.0.1", port, "", other.ca_pem))


def test_a_certificate_for_another_host_fails(tls_server: tuple[int, Pki]) -> None:
    port, pki = tls_server
    with pytest.raises(check.CheckFailedError, match="certificate not trusted"):
        check.check_endpoint(check.Endpoint("w", "localhost", port, "", pki.ca_pem))


def test_nothing_listening_fails(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, "server", ["127.0.0.1"])
    with pytest.raises(check.CheckFailedError, match=r"127\.0\.0\.1:1"):
        check.check_endpoint(check.Endpoint("w", "127.0.0.1", 1, "", pki.ca_pem), timeout=2)


def account_dir(tmp_path: Path, pki: Pki) -> Path:
    directory = tmp_path / "serviceaccount"
    directory.mkdir()
    (directory / "token").write_text(TOKEN + "\n")
    (directory / "ca.crt").write_text(pki.ca_pem)
    return directory


def test_main_checks_every_registered_webhook(
    tls_server: tuple[int, Pki],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    port, pki = tls_server
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    webhook = {"url": f"https://127.0.0.1:{port}", "caBundle": bundle(pki.ca_pem)}
    Handler.configurations = {
        f"{kind}/ws.weightsync.io": configuration(f"{kind}.ws.weightsync.io", webhook)
        for kind in check.KINDS
    }
    argv = [
        "ws.weightsync.io",
        "--timeout=5",
        f"--service-account-dir={account_dir(tmp_path, pki)}",
    ]
    assert check.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("TLS verified") == 2

    # A caBundle that does not match what the server presents fails the test.
    other = make_pki(tmp_path, "other", ["127.0.0.1"])
    Handler.configurations["validatingwebhookconfigurations/ws.weightsync.io"] = configuration(
        "v", {"url": f"https://127.0.0.1:{port}", "caBundle": bundle(other.ca_pem)}
    )
    monkeypatch.setattr(check, "POLL_SECONDS", 0.2)
    assert check.main([*argv[:1], "--timeout=1", argv[2]]) == 1
    assert "certificate not trusted" in capsys.readouterr().err


def test_main_fails_when_nothing_is_registered(
    tls_server: tuple[int, Pki],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    port, pki = tls_server
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    argv = ["absent", "--timeout=0.5", f"--service-account-dir={account_dir(tmp_path, pki)}"]
    assert check.main(argv) == 1
    assert "no webhooks registered" in capsys.readouterr().err


def test_main_reports_a_refused_token_without_a_traceback(
    tls_server: tuple[int, Pki],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    port, pki = tls_server
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    monkeypatch.setattr(check, "POLL_SECONDS", 0.1)
    accounts = account_dir(tmp_path, pki)
    (accounts / "token").write_text("not-the-token")
    argv = ["ws.weightsync.io", "--timeout=0.5", f"--service-account-dir={accounts}"]
    assert check.main(argv) == 1
    assert "HTTP 401" in capsys.readouterr().err


def test_main_dials_a_service_webhook_at_its_cluster_ip(
    tls_server: tuple[int, Pki],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No cluster DNS: the Service's ClusterIP comes from the API, the certificate is checked
    for `<service>.<namespace>.svc`, as the API server does."""
    port, pki = tls_server
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    webhook = {
        "service": {"name": "ws-webhook", "namespace": "ops", "port": port, "path": "/inject"},
        "caBundle": bundle(pki.ca_pem),
    }
    Handler.configurations = {
        f"{kind}/ws.weightsync.io": configuration(f"{kind}.ws.weightsync.io", webhook)
        for kind in check.KINDS
    }
    Handler.services = {"ops/services/ws-webhook": {"spec": {"clusterIP": "127.0.0.1"}}}
    argv = [
        "ws.weightsync.io",
        "--timeout=5",
        f"--service-account-dir={account_dir(tmp_path, pki)}",
    ]
    assert check.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("TLS verified") == 2
    assert f"https://ws-webhook.ops.svc:{port}/inject (at 127.0.0.1)" in out

    # A headless Service (or none) is named, not a name-resolution error.
    Handler.services = {"ops/services/ws-webhook": {"spec": {"clusterIP": "None"}}}
    assert check.main(argv) == 1
    assert "service ops/ws-webhook has no ClusterIP" in capsys.readouterr().err
    Handler.services = {}
    assert check.main(argv) == 1
    assert "service ops/ws-webhook does not exist" in capsys.readouterr().err
