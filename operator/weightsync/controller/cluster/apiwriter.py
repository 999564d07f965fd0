"""The controller's one way to write to the API server: every create, replace, patch and
delete it sends outside kopf goes through `ApiWriter`, on the event loop. No threads.

Why this path and not the official client's (#36): a version flip changes the gate of
every inference pod, and there is no batch write in the Kubernetes API: a thousand pods
are a thousand `PATCH .../pods/<name>/status`. Through the official client each costs
milliseconds of Python and a thread; a thread pool that size spends its time fighting
over the GIL with the event loop (a thousand gates one by one took 10 s). This client
sends the same requests with aiohttp from the event loop, `WRITERS` in flight (`apihttp`:
the official client's credentials and TLS settings). The status goes the same way: from
a thread, one write of it took 3 to 8 s while the loop was busy with a thousand pods
(the operator's log at `make scale`), 0.2 to 6.6 s from the loop (the API server's own
time, while it patches gates at its limit). The few other writes (Events, token Secrets,
deleted pods, the webhook configurations, the uninstall hook's) go the same way, so there
is one place that says how the operator writes: one timeout, one error type, one count.

What stays elsewhere: reads (GET, LIST) on the official client (`kube`, in threads; few,
and its caches and typed models help there) and the pod watch (`podwatch`); kopf's own
writes (finalizers, its progress annotations). Code with no event loop (the operator's
start before kopf runs, the uninstall hook) writes through `run_blocking`.

Errors are the official client's: `ApiException` with the HTTP status for a refused
request (callers' 404 and 409 handling is unchanged), `ConnectionError` when the API
server could not be reached or did not answer in `API_REQUEST_TIMEOUT_SECONDS`
(`kube.api_unavailable` reads both as "away"). Gate writes are the exception, see `set_condition`.

While a pass writes a WeightSync's status, gate writes not yet sent wait (`held`): the
status goes first, so `kubectl get wsync` never lags the gates, and a thousand gate
writes queued by the pass before would otherwise hold it up at the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine
from http import HTTPStatus
from typing import Any, TypeVar

import aiohttp
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import metrics
from weightsync.controller.cluster.apihttp import auth_headers, ssl_context
from weightsync.controller.runtime.timing import API_REQUEST_TIMEOUT_SECONDS

# The requests this module sends itself, for the chart's RBAC check (tests/unit/chart:
# every API call the controller makes is granted; literals, read from the source). A
# module that calls `create`, `replace`, `patch` or `delete` lists its own.
API_CALLS = (("", "pods/status", "patch"), ("weightsync.io", "weightsyncs/status", "patch"))
WRITERS = 32  # gate patches in flight at once
NOT_FOUND, CONFLICT = 404, 409
# Content types: a body as it is (create, replace, delete options), and the three patches.
JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"  # replaces lists whole; custom resources
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"  # built-in kinds only
JSON_PATCH = "application/json-patch+json"  # a list of operations

T = TypeVar("T")


class GateWriteError(RuntimeError):
    """A gate write the API server refused (other than for a pod that is gone)."""


def api_path(
    group: str, version: str, plural: str, *, namespace: str = "", name: str = "", sub: str = ""
) -> str:
    """The path of a collection, or of one object and its subresource (`group` "" is core)."""
    parts = ["/api", version] if not group else ["/apis", group, version]
    if namespace:
        parts += ["namespaces", namespace]
    parts.append(plural)
    if name:
        parts.append(name)
    if sub:
        parts.append(sub)
    return "/".join(parts)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


def _result(status: int) -> metrics.ApiResult:
    if status == NOT_FOUND:
        return metrics.ApiResult.NOT_FOUND
    if status == CONFLICT:
        return metrics.ApiResult.CONFLICT
    return metrics.ApiResult.ERROR


class ApiWriter:
    """Writes to the API server from the event loop; `close()` it when done."""

    def __init__(self, api: client.ApiClient) -> None:
        self._configuration = api.configuration
        self._state: tuple[aiohttp.ClientSession, asyncio.Semaphore] | None = None
        self._holds = 0  # `held` blocks open now
        self._open: asyncio.Event | None = None  # set while nothing holds the gate writes

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
        """The session and the gate writes' bound, made in the loop that uses them."""
        if self._state is None or self._state[0].closed:
            connector = aiohttp.TCPConnector(limit=WRITERS, ssl=ssl_context(self._configuration))
            timeout = aiohttp.ClientTimeout(total=API_REQUEST_TIMEOUT_SECONDS)
            session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self._state = (session, asyncio.Semaphore(WRITERS))
        return self._state

    def _headers(self, content_type: str | None = STRATEGIC_MERGE_PATCH) -> dict[str, str]:
        typed = {"Content-Type": content_type} if content_type else {}
        return {**typed, **auth_headers(self._configuration)}

    async def _exchange(
        self, method: str, path: str, body: Any, content_type: str, count: tuple[str, str]
    ) -> tuple[int, bytes]:
        """One request: its status and reply. Unreached: counted, aiohttp's error raised."""
        session, _ = self._client()
        data = None if body is None else json.dumps(body).encode()
        url = f"{self._configuration.host}{path}"
        try:
            headers = self._headers(content_type if data is not None else None)
            async with session.request(method, url, data=data, headers=headers) as reply:
                return reply.status, await reply.read()
        except (aiohttp.ClientError, TimeoutError):
            metrics.API_REQUESTS.labels(*count, metrics.ApiResult.UNREACHABLE).inc()
            raise

    async def _write(
        self, method: str, path: str, body: Any, content_type: str, count: tuple[str, str]
    ) -> dict[str, Any]:
        """One write, counted by `count` (verb, resource): the object the API server
        answered with; `ApiException` if it refused, `ConnectionError` if unreached."""
        try:
            status, raw = await self._exchange(method, path, body, content_type, count)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ConnectionError(f"{method} {path}: {error!r}") from error
        if not 200 <= status < 300:
            metrics.API_REQUESTS.labels(*count, _result(status)).inc()
            # As the official client's: the status, its phrase, the API server's Status.
            raise ApiException(
                status=status, reason=_phrase(status), body=raw.decode(errors="replace")
            )
        metrics.API_REQUESTS.labels(*count, metrics.ApiResult.OK).inc()
        answer: dict[str, Any] = json.loads(raw) if raw else {}
        return answer

    # -- any object: the path says which (`api_path`), `resource` names it in the count --

    async def create(self, path: str, body: dict[str, Any], *, resource: str) -> dict[str, Any]:
        """POST `body` to the collection at `path`."""
        return await self._write("POST", path, body, JSON, ("create", resource))

    async def replace(self, path: str, body: dict[str, Any], *, resource: str) -> dict[str, Any]:
        """PUT `body` over the object at `path`."""
        return await self._write("PUT", path, body, JSON, ("replace", resource))

    async def patch(
        self, path: str, body: Any, *, resource: str, content_type: str
    ) -> dict[str, Any]:
        """PATCH the object at `path`: `MERGE_PATCH`, `STRATEGIC_MERGE_PATCH` (built-in
        kinds) or `JSON_PATCH` (`body` a list of operations)."""
        return await self._write("PATCH", path, body, content_type, ("patch", resource))

    async def delete(
        self, path: str, *, resource: str, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """DELETE the object at `path`, with DeleteOptions (preconditions) if given."""
        return await self._write("DELETE", path, options, JSON, ("delete", resource))

    # -- the pass's own, many at once ------------------------------------------------

    async def patch_status(
        self, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """Replace a WeightSync's status (a JSON merge patch replaces lists whole); the
        object after."""
        path = api_path(GROUP, VERSION, PLURAL, namespace=namespace, name=name, sub="status")
        return await self.patch(
            path, {"status": status}, resource="weightsyncs/status", content_type=MERGE_PATCH
        )

    async def set_condition(self, namespace: str, pod: str, condition: dict[str, Any]) -> None:
        """Set one pod condition (keyed by type, the others stay), `WRITERS` at a time and
        none while `held`. A pod that is gone has nothing to gate; a refusal raises
        `GateWriteError`, an API server not reached aiohttp's error (`gatesync` logs both)."""
        _, slots = self._client()
        path = api_path("", "v1", "pods", namespace=namespace, name=pod, sub="status")
        body = {"status": {"conditions": [condition]}}
        count = ("patch", "pods/status")
        await self._opened().wait()
        async with slots:
            status, _ = await self._exchange("PATCH", path, body, STRATEGIC_MERGE_PATCH, count)
        if status == NOT_FOUND:
            metrics.API_REQUESTS.labels(*count, metrics.ApiResult.NOT_FOUND).inc()
            return
        if not 200 <= status < 300:
            metrics.API_REQUESTS.labels(*count, metrics.ApiResult.ERROR).inc()
            raise GateWriteError(f"patch of pod {namespace}/{pod} status: HTTP {status}")
        metrics.API_REQUESTS.labels(*count, metrics.ApiResult.OK).inc()

    def run_blocking(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` (writes through this writer) to its end on an event loop of its own,
        for code that has none: the operator's start before kopf runs, the uninstall hook.
        The session opened for it closes with that loop; the next loop opens its own."""

        async def scoped() -> T:
            try:
                return await work
            finally:
                await self.close()

        return asyncio.run(scoped())

    async def close(self) -> None:
        if self._state is not None:
            await self._state[0].close()
            self._state = None
