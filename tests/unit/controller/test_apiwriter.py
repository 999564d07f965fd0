"""The API writer authenticates as the official client would, in a pod and from a
kubeconfig, holds its gate writes while a status is written, writes a status and any
other object as the official client did (the method, the content type; its errors), and
runs from code with no event loop."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.support.serving import start
from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller.cluster.apiwriter import (
    JSON_PATCH,
    MERGE_PATCH,
    STRATEGIC_MERGE_PATCH,
    ApiWriter,
    api_path,
)


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
        runner, port = await start(app)
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
        runner, port = await start(app)
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


def test_any_object_is_written_as_the_official_client_wrote_it() -> None:
    """create, replace, the three patches and delete: the method, the content type the
    official client chose for each and the body as given; a refusal is its `ApiException`
    (the status callers test), an empty answer an empty object."""
    seen: list[tuple[str, str, str | None, object]] = []

    async def record(request: web.Request) -> web.Response:
        raw = await request.read()
        seen.append((request.method, request.path, request.headers.get("Content-Type"),
                     json.loads(raw) if raw else None))  # fmt: skip
        if request.match_info["tail"].endswith("taken"):
            return web.json_response({"kind": "Status", "code": 409}, status=409)
        if request.method == "DELETE":
            return web.Response(status=200)
        return web.json_response({"metadata": {"name": "x"}})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        runner, port = await start(app)
        writer = ApiWriter(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
        secrets = api_path("", "v1", "secrets", namespace="ns")
        scale = api_path("apps", "v1", "deployments", namespace="ns", name="d", sub="scale")
        config = api_path("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations",
                          name="c")  # fmt: skip
        try:
            assert await writer.create(secrets, {"a": 1}, resource="secrets") == {
                "metadata": {"name": "x"}
            }
            await writer.replace(f"{secrets}/s", {"a": 2}, resource="secrets")
            await writer.patch(scale, {"spec": {}}, resource="deployments/scale",
                               content_type=STRATEGIC_MERGE_PATCH)  # fmt: skip
            await writer.patch(config, [{"op": "add"}], resource="mutatingwebhookconfigurations",
                               content_type=JSON_PATCH)  # fmt: skip
            await writer.patch(f"{secrets}/s", {}, resource="secrets", content_type=MERGE_PATCH)
            options = {"preconditions": {"uid": "u"}}
            assert await writer.delete(f"{secrets}/s", resource="secrets", options=options) == {}
            await writer.delete(config, resource="mutatingwebhookconfigurations")
            with pytest.raises(ApiException) as taken:
                await writer.create(f"{secrets}/taken", {}, resource="secrets")
            assert (taken.value.status, taken.value.reason) == (409, "Conflict")
            assert '"code": 409' in (taken.value.body or "")  # the API server's Status
        finally:
            await writer.close()
            await runner.cleanup()
        assert seen[:7] == [
            ("POST", "/api/v1/namespaces/ns/secrets", "application/json", {"a": 1}),
            ("PUT", "/api/v1/namespaces/ns/secrets/s", "application/json", {"a": 2}),
            ("PATCH", "/apis/apps/v1/namespaces/ns/deployments/d/scale",
             "application/strategic-merge-patch+json", {"spec": {}}),
            ("PATCH", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/c",
             "application/json-patch+json", [{"op": "add"}]),
            ("PATCH", "/api/v1/namespaces/ns/secrets/s", "application/merge-patch+json", {}),
            ("DELETE", "/api/v1/namespaces/ns/secrets/s", "application/json", options),
            ("DELETE", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/c",
             None, None),
        ]  # fmt: skip

    asyncio.run(scenario())


def test_run_blocking_writes_without_a_loop_and_leaves_the_writer_usable() -> None:
    """The operator's start and the uninstall hook have no event loop: each `run_blocking`
    runs on a loop of its own and closes its session, so the next loop opens a new one."""
    unreachable = ApiWriter(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")))
    for _ in range(2):
        with pytest.raises(ConnectionError):
            unreachable.run_blocking(unreachable.create("/api/v1/x", {}, resource="x"))
        assert unreachable._state is None
