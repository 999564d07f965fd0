"""The uninstall hook leaves no finalizer behind, also one a terminating operator adds
back after the hook removed it (the Deployment counts no terminating pod)."""

from __future__ import annotations

import argparse
import asyncio
import copy
import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

from aiohttp import web
from kubernetes import client

from tests.support.serving import start
from weightsync.controller import names, uninstall
from weightsync.controller.cluster.kube import Kube

SYNC = {
    "metadata": {"name": "s", "namespace": "ns", "uid": "u", "resourceVersion": "5",
                 "finalizers": [names.FINALIZER, "other.io/keep"]},
}  # fmt: skip


def run(readded: int, grace: float) -> tuple[list[dict[str, Any]], float]:
    """Uninstall against a served API whose WeightSync gets the finalizer back `readded`
    times; the finalizer patches sent and the seconds the hook took."""
    patches: list[dict[str, Any]] = []
    state = {"held": True, "readded": readded}

    async def patch(request: web.Request) -> web.Response:
        if "weightsyncs" in request.path:
            patches.append(await request.json())
            state["held"] = False
        return web.json_response({})

    def listed(_: str) -> list[dict[str, Any]]:
        if not state["held"] and state["readded"]:  # the stopping operator handled it
            state["readded"] -= 1
            state["held"] = True
        sync = copy.deepcopy(SYNC)
        if not state["held"]:
            sync["metadata"]["finalizers"] = ["other.io/keep"]
        return [sync]

    async def scenario() -> float:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", patch)
        runner, port = await start(app)
        kube = Kube(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
        args = argparse.Namespace(operator_namespace="ops", deployment="op", test_pod="",
                                  webhook_configuration="ws", namespace=["ns"],
                                  operator_grace_seconds=grace)  # fmt: skip
        began = time.monotonic()
        try:
            with (
                mock.patch.object(uninstall, "SIGKILL_MARGIN_SECONDS", 0.0),
                mock.patch.object(uninstall, "RECHECK_SECONDS", 0.1),
                mock.patch.object(kube.apps, "read_namespaced_deployment",
                                  return_value=SimpleNamespace(status=None)),
                mock.patch.object(kube, "list_weightsyncs", side_effect=listed),
                mock.patch.object(uninstall.pod_actions, "release"),
            ):  # fmt: skip
                await uninstall.uninstall(kube, args)
        finally:
            await kube.writer.close()
            await runner.cleanup()
        return time.monotonic() - began

    took = asyncio.run(scenario())
    return patches, took


def test_a_finalizer_added_back_during_the_grace_period_is_dropped_again() -> None:
    patches, took = run(readded=2, grace=1.0)
    assert len(patches) == 3
    assert all(p["metadata"]["finalizers"] == ["other.io/keep"] for p in patches)
    assert took >= 1.0  # it watched for the whole grace period


def test_with_nothing_added_back_the_finalizer_is_dropped_once() -> None:
    patches, _ = run(readded=0, grace=0.5)
    assert len(patches) == 1
