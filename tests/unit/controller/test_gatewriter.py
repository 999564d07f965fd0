"""The gate writer authenticates as the official client would, in a pod and from a kubeconfig."""

from __future__ import annotations

from kubernetes import client

from weightsync.controller.gatewriter import GateWriter


def _writer(api_key: dict[str, str], prefix: dict[str, str] | None = None) -> GateWriter:
    configuration = client.Configuration(host="https://10.0.0.1:443")
    configuration.api_key = api_key
    configuration.api_key_prefix = prefix or {}
    return GateWriter(client.ApiClient(configuration))


def test_an_in_cluster_token_is_sent() -> None:
    # What load_incluster_config stores: the token under BearerToken, "bearer " included.
    headers = _writer({"BearerToken": "bearer abc"})._headers()
    assert headers["Authorization"] == "bearer abc"


def test_a_kubeconfig_token_is_sent() -> None:
    headers = _writer({"authorization": "xyz"}, {"authorization": "Bearer"})._headers()
    assert headers["Authorization"] == "Bearer xyz"


def test_client_certificates_need_no_header() -> None:
    headers = _writer({})._headers()
    assert "Authorization" not in headers
    assert headers["Content-Type"] == "application/strategic-merge-patch+json"
