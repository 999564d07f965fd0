"""The reconciler's writes on the event loop: readiness gates, many pod-status patches at
once, and WeightSync statuses. No threads.

A version flip changes the gate of every inference pod, and there is no batch write
in the Kubernetes API: a thousand pods are a thousand `PATCH .../pods/<name>/status`.
Through the official client each costs milliseconds of Python and a thread; a thread
pool that size spends its time fighting over the GIL with the event loop. This client
sends the same requests with aiohttp from the event loop, `WRITERS` in flight
(`apihttp`: the official client's credentials and TLS settings). The status goes the
same way: from a thread, one write of it took 3 to 8 s while the loop was busy with a
thousand pods (the operator's log at `make scale`), 0.2 to 6.6 s from the loop (the API
server's own time, while it patches gates at its limit).

While a pass writes a WeightSync's status, gate writes not yet sent wait (`held`): the
status goes first, so `kubectl get wsync` never lags the gates, and a thousand gate
writes queued by the pass before would otherwise hold it up at the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import metrics
from weightsync.controller.cluster.apihttp import auth_headers, ssl_context

# The requests this module sends past the official client, for the chart's RBAC check
# (tests/unit/chart: every API call the controller makes is granted; literals, read
# from the source).
API_CALLS = (("", "pods/status", "patch"), ("weightsync.io", "weightsyncs/status", "patch"))
WRITERS = 32  # patches in flight at once
TIMEOUT_SECONDS = 30.0  # one patch, as kopf's own API requests (`main.configure_kopf`)
NOT_FOUND = 404
STRATEGIC_MERGE = "application/strategic-merge-patch+json"


class GateWriteError(RuntimeError):
    """A gate write the API server refused (other than for a pod that is gone)."""


class ApiWriter:
    """Pod status conditions (strategic merge) and WeightSync statuses (merge patch),
    from the event loop; `close()` it when done."""

    def __init__(self, api: client.ApiClient) -> None:
        self._configuration = api.configuration
        self._state: tuple[aiohttp.ClientSession, asyncio.Semaphore] | None = None
        self._holds = 0  # `held` blocks open now
        self._open: asyncio.Event | None = None  # set while nothing holds the writes

    def _opened(self) -> asyncio.Event:
        if self._open is None:  # made in the loop that uses it
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Start no gate write inside this block (those in flight finish)."""
        opened = self._opened()
        self._holds += 1
        opened.clear()
        try:
            yield
        finally:
            self._holds -= 1
            if self._holds == 0:
                opened.set()

    def _client(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """The session and the in-flight bound, made in the loop that uses them."""
        if self._state is None or self._state[0].closed:
            connector = aiohttp.TCPConnector(limit=WRITERS, ssl=ssl_context(self._configuration))
            timeout = aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)
            session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self._state = (session, asyncio.Semaphore(WRITERS))
        return self._state

    def _headers(self, content_type: str = STRATEGIC_MERGE) -> dict[str, str]:
        return {"Content-Type": content_type, **auth_headers(self._configuration)}

    async def patch_status(
        self, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """Replace a WeightSync's status (a JSON merge patch replaces lists whole); the
        object after. Errors as the official client raises them (`ApiException`), or
        `ConnectionError` when the API server could not be reached."""
        session, _ = self._client()
        url = (
            f"{self._configuration.host}/apis/{GROUP}/{VERSION}/namespaces/{namespace}"
            f"/{PLURAL}/{name}/status"
        )
        body = json.dumps({"status": status}).encode()
        headers = self._headers("application/merge-patch+json")
        try:
            async with session.patch(url, data=body, headers=headers) as reply:
                raw = await reply.read()
                code = reply.status
        except (aiohttp.ClientError, TimeoutError) as error:
            metrics.API_REQUESTS.labels(
                "patch", "weightsyncs/status", metrics.ApiResult.UNREACHABLE
            ).inc()
            raise ConnectionError(f"patch of {namespace}/{name} status: {error!r}") from error
        if not 200 <= code < 300:
            result = metrics.ApiResult.NOT_FOUND if code == NOT_FOUND else metrics.ApiResult.ERROR
            metrics.API_REQUESTS.labels("patch", "weightsyncs/status", result).inc()
            raise ApiException(status=code, reason=raw.decode(errors="replace")[:512])
        metrics.API_REQUESTS.labels("patch", "weightsyncs/status", metrics.ApiResult.OK).inc()
        after: dict[str, Any] = json.loads(raw)
        return after

    async def set_condition(self, namespace: str, pod: str, condition: dict[str, Any]) -> None:
        """Set one pod condition (keyed by type, the others stay); a pod that is gone
        has nothing to gate."""
        session, slots = self._client()
        url = f"{self._configuration.host}/api/v1/namespaces/{namespace}/pods/{pod}/status"
        body = json.dumps({"status": {"conditions": [condition]}}).encode()
        await self._opened().wait()
        async with slots:
            try:
                async with session.patch(url, data=body, headers=self._headers()) as reply:
                    await reply.read()
                    status = reply.status
            except (aiohttp.ClientError, TimeoutError):
                metrics.API_REQUESTS.labels(
                    "patch", "pods/status", metrics.ApiResult.UNREACHABLE
                ).inc()
                raise
        if status == NOT_FOUND:
            metrics.API_REQUESTS.labels("patch", "pods/status", metrics.ApiResult.NOT_FOUND).inc()
            return
        if not 200 <= status < 300:
            metrics.API_REQUESTS.labels("patch", "pods/status", metrics.ApiResult.ERROR).inc()
            raise GateWriteError(f"patch of pod {namespace}/{pod} status: HTTP {status}")
        metrics.API_REQUESTS.labels("patch", "pods/status", metrics.ApiResult.OK).inc()

    async def close(self) -> None:
        if self._state is not None:
            await self._state[0].close()
            self._state = None
