"""Operator settings from the environment; webhook certificates that real TLS accepts."""

from __future__ import annotations

import socket
import ssl
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from weightsync.controller.admission import certs
from weightsync.controller.admission.webhook import client_config, serving_hosts
from weightsync.controller.settings import CertMode, OperatorSettings, SettingsError

URL_MODE = {"WEIGHTSYNC_OPERATOR_WEBHOOK_URL": "https://127.0.0.1:9443"}


def test_url_mode_defaults() -> None:
    settings = OperatorSettings.from_env({**URL_MODE, "PATH": "/bin"})
    assert settings.webhook_host == "127.0.0.1"
    assert settings.webhook_certs is CertMode.MANAGED
    assert client_config(settings) == {"url": "https://127.0.0.1:9443"}
    assert serving_hosts(settings) == ["127.0.0.1"]


def test_service_mode() -> None:
    settings = OperatorSettings.from_env(
        {
            "WEIGHTSYNC_OPERATOR_WEBHOOK_SERVICE_NAME": "weightsync-webhook",
            "WEIGHTSYNC_OPERATOR_NAMESPACE": "ws",
            "WEIGHTSYNC_OPERATOR_WATCH_NAMESPACES": "a, b,",
            "WEIGHTSYNC_OPERATOR_AGENT_HTTP_PORT": "9000",
        }
    )
    assert settings.watch_namespaces == ("a", "b")
    assert settings.agent_http_port == 9000
    assert client_config(settings) == {
        "service": {"name": "weightsync-webhook", "namespace": "ws", "port": 443, "path": ""}
    }
    assert "weightsync-webhook.ws.svc" in serving_hosts(settings)


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({}, "exactly one of WEBHOOK_URL"),
        ({**URL_MODE, "WEIGHTSYNC_OPERATOR_WEBHOOK_SERVICE_NAME": "x"}, "exactly one of"),
        ({"WEIGHTSYNC_OPERATOR_WEBHOOK_URL": "http://x:1"}, "https://"),
        ({**URL_MODE, "WEIGHTSYNC_OPERATOR_RESYNC_SECOND": "1"}, "RESYNC_SECOND is not"),
        ({**URL_MODE, "WEIGHTSYNC_OPERATOR_AGENT_HTTP_PORT": "0"}, "AGENT_HTTP_PORT"),
        ({**URL_MODE, "WEIGHTSYNC_OPERATOR_WEBHOOK_CERTS": "directory"}, "WEBHOOK_CERT_DIR"),
        ({**URL_MODE, "WEIGHTSYNC_OPERATOR_WEBHOOK_CONFIGURATION": "weightsync"}, "needs a dot"),
    ],
)
def test_bad_environments_fail_naming_the_variable(env: dict[str, str], complaint: str) -> None:
    with pytest.raises(SettingsError, match=complaint):
        OperatorSettings.from_env(env)


def test_generated_certificates_serve_tls_that_the_ca_verifies(tmp_path: Path) -> None:
    bundle = certs.generate(["127.0.0.1", "webhook.ws.svc"])
    cert, key, ca = bundle.write(tmp_path)
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        connection, _ = listener.accept()
        with server_context.wrap_socket(connection, server_side=True) as tls:
            tls.sendall(b"ok")

    thread = threading.Thread(target=serve)
    thread.start()
    client_context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        client_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.recv(2) == b"ok"
    thread.join()
    listener.close()


def test_stored_certificates_are_reused_only_while_they_fit() -> None:
    now = datetime.now(UTC)
    bundle = certs.generate(["webhook.ws.svc", "10.0.0.1"], now=now)
    assert certs.usable(bundle, ["webhook.ws.svc", "10.0.0.1"])
    assert not certs.usable(bundle, ["other.ws.svc"])
    assert not certs.usable(bundle, ["webhook.ws.svc"], now=now + timedelta(days=340))
    stranger = certs.generate(["webhook.ws.svc"])
    mixed = certs.TlsBundle(cert=bundle.cert, key=bundle.key, ca=stranger.ca)
    assert not certs.usable(mixed, ["webhook.ws.svc"])
    assert certs.TlsBundle.from_secret_data(bundle.to_secret_data()) == bundle
    assert certs.TlsBundle.from_secret_data({"tls.crt": "eA=="}) is None
