"""Readiness-gate writes on the event loop: many pod-status patches at once, no threads.

A version flip changes the gate of every inference pod, and there is no batch write
in the Kubernetes API: a thousand pods are a thousand `PATCH .../pods/<name>/status`.
Through the official client each costs milliseconds of Python and a thread; a thread
pool that size spends its time fighting over the GIL with the event loop. This client
sends the same requests with aiohttp from the event loop, `WRITERS` in flight
(`apihttp`: the official client's credentials and TLS settings).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from kubernetes import client

from weightsync.controller import metrics
from weightsync.controller.apihttp import auth_headers, ssl_context

# The request this module sends past the official client, for the chart's RBAC check
# (tests/unit/chart: every API call the controller makes is granted).
API_CALLS = (("", "pods/status", "patch"),)
WRITERS = 32  # patches in flight at once
TIMEOUT_SECONDS = 30.0  # one patch, as kopf's own API requests (`main.configure_kopf`)
NOT_FOUND = 404


class GateWriteError(RuntimeError):
    """A gate write the API server refused (other than for a pod that is gone)."""


class GateWriter:
    """Strategic-merge patches of pod status conditions; `close()` it when done."""

    def __init__(self, api: client.ApiClient) -> None:
        self._configuration = api.configuration
        self._state: tuple[aiohttp.ClientSession, asyncio.Semaphore] | None = None

    def _client(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """The session and the in-flight bound, made in the loop that uses them."""
        if self._state is None or self._state[0].closed:
            connector = aiohttp.TCPConnector(limit=WRITERS, ssl=ssl_context(self._configuration))
            timeout = aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)
            session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self._state = (session, asyncio.Semaphore(WRITERS))
        return self._state

    def _headers(self) -> dict[str, str]:
        return {
            "Content-Type": "application/strategic-merge-patch+json",
            **auth_headers(self._configuration),
        }

    async def set_condition(self, namespace: str, pod: str, condition: dict[str, Any]) -> None:
        """Set one pod condition (keyed by type, the others stay); a pod that is gone
        has nothing to gate."""
        session, slots = self._client()
        url = f"{self._configuration.host}/api/v1/namespaces/{namespace}/pods/{pod}/status"
        body = json.dumps({"status": {"conditions": [condition]}}).encode()
        async with slots:
            try:
                async with session.patch(url, data=body, headers=self._headers()) as reply:
                    await reply.read()
                    status = reply.status
            except (aiohttp.ClientError, TimeoutError):
                metrics.API_REQUESTS.labels("patch", "pods/status", "unreachable").inc()
                raise
        if status == NOT_FOUND:
            metrics.API_REQUESTS.labels("patch", "pods/status", "not_found").inc()
            return
        if not 200 <= status < 300:
            metrics.API_REQUESTS.labels("patch", "pods/status", "error").inc()
            raise GateWriteError(f"patch of pod {namespace}/{pod} status: HTTP {status}")
        metrics.API_REQUESTS.labels("patch", "pods/status", "ok").inc()

    async def close(self) -> None:
        if self._state is not None:
            await self._state[0].close()
            self._state = None
