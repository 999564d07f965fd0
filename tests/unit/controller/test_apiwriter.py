"""The API writer authenticates as the official client would, in a pod and from a
kubeconfig, holds its gate writes while a status is written, and writes a status as
the official client did (a merge patch; its errors)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller.cluster.apiwriter import ApiWriter


def _writer(api_key: dict[str, str], prefix: dict[str, str] | None = None) -> ApiWriter:
    configuration = client.Configuration(host="https://10.0.0.1:443")
    configuration.api_key = api_key
    configuration.api_key_prefix = prefix or {}
    return ApiWriter(client.ApiClient(configuration))


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


def test_no_gate_write_starts_while_held() -> None:
    """While a status is written (`held`), a gate write waits; it is sent right after."""
    arrived: list[str] = []

    async def patch(request: web.Request) -> web.Response:
        arrived.append(request.match_info["pod"])
        return web.json_response({})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_patch("/api/v1/namespaces/ns/pods/{pod}/status", patch)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        writer = ApiWriter(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
        try:
            await writer.set_condition("ns", "before", {"type": "t"})
            async with writer.held():
                task = asyncio.create_task(writer.set_condition("ns", "during", {"type": "t"}))
                await asyncio.sleep(0.3)
                assert arrived == ["before"]
            await asyncio.wait_for(task, 10)
            assert arrived == ["before", "during"]
        finally:
            await writer.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_status_is_merge_patched_and_errors_read_as_the_official_clients() -> None:
    seen: list[tuple[str, str, dict[str, object]]] = []

    async def patch(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, request.content_type, body))
        if request.match_info["name"] == "gone":
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response({"metadata": {"resourceVersion": "7"}, **body})

    async def scenario() -> None:
        app = web.Application()
        path = f"/apis/{GROUP}/{VERSION}/namespaces/ns/{PLURAL}/{{name}}/status"
        app.router.add_patch(path, patch)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        writer = ApiWriter(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
        unreachable = ApiWriter(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")))
        try:
            after = await writer.patch_status("ns", "sync", {"members": []})
            assert after == {"metadata": {"resourceVersion": "7"}, "status": {"members": []}}
            assert seen[0][1] == "application/merge-patch+json"
            with pytest.raises(ApiException) as gone:
                await writer.patch_status("ns", "gone", {})
            assert gone.value.status == 404
            with pytest.raises(ConnectionError):
                await unreachable.patch_status("ns", "sync", {})
        finally:
            await writer.close()
            await unreachable.close()
            await runner.cleanup()

    asyncio.run(scenario())
