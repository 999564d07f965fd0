"""Every write the controller sends through its one writer is one it declares.

The RBAC check (`test_operator_contract`) reads the controller's API calls from its
source: the official client's method names, and the `API_CALLS` literals of modules that
send requests themselves. Writes go through `ApiWriter` with a path, so a module's
`API_CALLS` is all the check sees of them: here each write is sent to a recording API
server and the request it became must be among the declared calls.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any
from unittest import mock

from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.support.serving import start
from tests.unit.chart.test_operator_contract import api_calls_in_controller
from weightsync.controller import uninstall
from weightsync.controller.admission import webhook
from weightsync.controller.admission.webhook_config import Configurations
from weightsync.controller.cluster import tokens
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.cluster.leases import Leases
from weightsync.controller.leadership.lease import LeaseRecord
from weightsync.controller.settings import OperatorSettings

_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
SYNC = {
    "apiVersion": "weightsync.io/v1alpha1",
    "kind": "WeightSync",
    "metadata": {"name": "s", "namespace": "ns", "uid": "u", "resourceVersion": "5",
                 "finalizers": ["weightsync.io/finalizer"]},
}  # fmt: skip


def call_of(method: str, path: str) -> tuple[str, str, str]:
    """(group, resource, verb) of a request, as RBAC names it."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    return group, resource, _VERBS[method]


@asynccontextmanager
async def recording() -> AsyncIterator[tuple[Kube, list[tuple[str, str, str]]]]:
    """A Kube whose writes reach a server that records them (a token Secret's first
    create answered 409, so that it is replaced)."""
    sent: list[tuple[str, str, str]] = []

    async def record(request: web.Request) -> web.Response:
        sent.append(call_of(request.method, request.path))
        if request.method == "POST" and request.path.endswith("/ns/secrets"):
            return web.json_response({"code": 409}, status=409)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner, port = await start(app)
    kube = Kube(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
    try:
        yield kube, sent
    finally:
        await kube.writer.close()
        await runner.cleanup()


def _gone(*_: Any) -> Any:
    raise ApiException(status=404)


async def every_write(kube: Kube) -> None:
    await kube.create_event("ns", {"metadata": {"namespace": "ns"}})
    await kube.write_token("ns", SYNC, "token")
    await kube.delete_pod("ns", "p", "uid")
    await kube.writer.patch_status("ns", "s", {})
    await kube.writer.set_condition("ns", "p", {"type": "t"})
    with mock.patch.object(kube.core, "read_namespaced_secret", _gone):
        await tokens.load_key(kube, "ops", "key")
        settings = OperatorSettings(webhook_url="https://127.0.0.1:9443")
        await webhook.managed_bundle(kube, settings)
    stored = SimpleNamespace(data={}, metadata=SimpleNamespace(resource_version="3"))
    with mock.patch.object(kube.core, "read_namespaced_secret", return_value=stored):
        await webhook.managed_bundle(kube, settings)  # replaced
    leases = Leases(kube, "ops", "ws-leader")
    stored_lease = await leases.write(LeaseRecord("op-a", 10), within=5.0)  # created
    await leases.write(replace(stored_lease, resource_version="1"), within=5.0)  # replaced
    configurations = Configurations(kube.writer, "ws")
    await configurations.apply({"url": "https://127.0.0.1:9443"})
    await configurations.apply(None)
    args = argparse.Namespace(operator_namespace="ops", deployment="op", test_pod="t",
                              webhook_configuration="ws", namespace=["ns"],
                              operator_grace_seconds=-10.0)  # fmt: skip
    stopped = SimpleNamespace(status=None)
    with (
        mock.patch.object(kube.apps, "read_namespaced_deployment", return_value=stopped),
        mock.patch.object(kube, "list_weightsyncs", return_value=[SYNC]),
        mock.patch.object(uninstall.pod_actions, "release"),
    ):
        await uninstall.uninstall(kube, args)


def test_every_write_the_controller_sends_is_declared_for_rbac() -> None:
    async def scenario() -> list[tuple[str, str, str]]:
        async with recording() as (kube, sent):
            await every_write(kube)
        return sent

    sent = asyncio.run(scenario())
    assert ("", "secrets", "update") in sent  # the 409 led to a replace
    assert ("weightsync.io", "weightsyncs", "patch") in sent  # the uninstall hook's
    assert ("coordination.k8s.io", "leases", "update") in sent  # a renewal
    assert set(sent) <= api_calls_in_controller(), sorted(set(sent) - api_calls_in_controller())
