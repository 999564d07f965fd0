"""The labelled pods, from the operator's own watch: each event decoded once and kept slim.

kopf watched them before, for an index and an event handler, and each pod event cost
the operator about 5 ms of CPU (kopf's per-object worker, its body wrappers, the
index's bookkeeping): while 1,000 pods scaled up that was most of the operator's CPU,
on a machine the API server already filled (docs/benchmarks.md). Here an event is one
`json.loads`, one slim copy (`cache.slim_pod`) and a callback.

It is the API server's list-then-watch: list (in pages), watch from the list's
resourceVersion with bookmarks, resume from the last version seen when the server ends
a watch, list again when it no longer has that version (410 Gone). A list calls back
what changed since the store last saw it, deletions included. Until the first list is
in, `PodStore.pods_of` answers None and a pass lists for itself (`kube.observe`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp
from kubernetes import client

from weightsync.controller import metrics
from weightsync.controller.cluster.apihttp import auth_headers, ssl_context
from weightsync.controller.cluster.cache import pod_key, slim_pod
from weightsync.controller.runtime.timing import (
    API_CONNECT_TIMEOUT_SECONDS,
    WATCH_CLIENT_TIMEOUT_SECONDS,
    WATCH_SERVER_TIMEOUT_SECONDS,
)

log = logging.getLogger(__name__)

# The requests this module sends past the official client (tests/unit/chart: RBAC).
API_CALLS = (("", "pods", "list"), ("", "pods", "watch"))
ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
PAGE = 500  # pods per list request
MAX_BACKOFF_SECONDS = 30
MIN_WATCH_SECONDS = 1.0  # between the starts of two watches that ended normally
GONE = 410

# (event type, namespace, the pod as the API server sent it; its slim copy for a
# deletion seen only by a list)
PodCallback = Callable[[str, str, Mapping[str, Any]], None]


class ExpiredError(Exception):
    """The API server no longer has the version asked for: list again."""


class WatchError(RuntimeError):
    """A list or watch the API server refused."""


class PodStore:
    """Slim pods by controller owner (namespace, uid), as the watch last saw them.

    Passes read it from worker threads (`kube.observe` runs in `asyncio.to_thread`) while
    the event loop writes: a read copies one owner's pods in one C call, and a write
    replaces a pod in place, so a reader never sees a pod missing that is only changing.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        self._known: dict[str, tuple[str | None, dict[str, Any]]] = {}  # uid: (version, slim)
        self._listed: set[str | None] = set()  # namespaces listed; None: every namespace

    def pods_of(self, namespace: str, owner_uid: str) -> list[Mapping[str, Any]] | None:
        """The pods a StatefulSet or ReplicaSet controls; None before its namespace's first
        list is in."""
        if None not in self._listed and namespace not in self._listed:
            return None
        return list(self._groups.get((namespace, owner_uid), {}).values())

    def put(self, pod: Mapping[str, Any]) -> str | None:
        """Keep `pod`; the change it makes (ADDED or MODIFIED), None if that version is kept."""
        meta = pod["metadata"]
        uid, version = str(meta["uid"]), meta.get("resourceVersion")
        old = self._known.get(uid)
        if old is not None and version is not None and old[0] == version:
            return None
        slim = slim_pod(pod)
        key = pod_key(str(meta.get("namespace")), slim)
        if old is not None and pod_key(str(meta.get("namespace")), old[1]) != key:
            self._ungroup(uid, old[1])
        self._known[uid] = (version, slim)
        if key is not None:
            self._groups.setdefault(key, {})[uid] = slim
        return ADDED if old is None else MODIFIED

    def drop(self, uid: str) -> dict[str, Any] | None:
        """Forget a pod; its slim copy, or None if it was not kept."""
        old = self._known.pop(uid, None)
        if old is None:
            return None
        self._ungroup(uid, old[1])
        return old[1]

    def relist(
        self, scope: str | None, pods: Iterable[Mapping[str, Any]]
    ) -> list[tuple[str, Mapping[str, Any]]]:
        """Replace what is kept of `scope` (a namespace, None: all) by a list of it; the
        changes, as a watch would have brought them."""
        changes: list[tuple[str, Mapping[str, Any]]] = []
        listed = set()
        for pod in pods:
            listed.add(str(pod["metadata"]["uid"]))
            change = self.put(pod)
            if change is not None:
                changes.append((change, pod))
        for uid, (_, slim) in list(self._known.items()):
            in_scope = scope is None or slim["metadata"].get("namespace") == scope
            if in_scope and uid not in listed:
                self.drop(uid)
                changes.append((DELETED, slim))
        self._listed.add(scope)
        return changes

    def _ungroup(self, uid: str, slim: Mapping[str, Any]) -> None:
        key = pod_key(str(slim["metadata"].get("namespace")), slim)
        group = self._groups.get(key) if key is not None else None
        if group is not None:
            group.pop(uid, None)
            if not group:
                del self._groups[key]  # type: ignore[arg-type]  # not None when grouped


class PodWatch:
    """Keeps `store` from list-then-watch of the pods matching `selector` in `namespaces`
    (empty: every namespace), and calls `on_change` for each change. `run` until cancelled."""

    def __init__(
        self,
        api: client.ApiClient,
        selector: str,
        namespaces: Sequence[str],
        store: PodStore,
        on_change: PodCallback,
    ) -> None:
        self._configuration = api.configuration
        self._selector = selector
        self._scopes: list[str | None] = list(namespaces) or [None]
        self.store = store
        self._on_change = on_change

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=API_CONNECT_TIMEOUT_SECONDS,
            sock_read=WATCH_CLIENT_TIMEOUT_SECONDS,
        )
        connector = aiohttp.TCPConnector(ssl=ssl_context(self._configuration))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._follow(session, scope) for scope in self._scopes))

    async def _follow(self, session: aiohttp.ClientSession, scope: str | None) -> None:
        """List and watch one scope for good: failures are logged and retried with backoff."""
        version: str | None = None
        failures = 0
        while True:
            try:
                if version is None:
                    version = await self._list(session, scope)
                began = time.monotonic()
                version = await self._watch(session, scope, version)
                failures = 0
                # A watch the server (or a proxy) ends at once must not become a loop of
                # requests: the next one waits out the rest of a second.
                await asyncio.sleep(max(0.0, began + MIN_WATCH_SECONDS - time.monotonic()))
            except ExpiredError as error:
                log.info("pod watch of %s: %s; listing again", _named(scope), error)
                version = None
            except Exception as error:  # a stopped watch would leave passes blind for good
                failures += 1
                delay = min(MAX_BACKOFF_SECONDS, 2 ** (failures - 1))
                known = isinstance(error, aiohttp.ClientError | TimeoutError | WatchError)
                log.warning(
                    "pod watch of %s: %r; again in %d s", _named(scope), error, delay,
                    exc_info=None if known else error,
                )  # fmt: skip
                await asyncio.sleep(delay)

    def _url(self, scope: str | None) -> str:
        host = self._configuration.host
        return f"{host}/api/v1/namespaces/{scope}/pods" if scope else f"{host}/api/v1/pods"

    async def _list(self, session: aiohttp.ClientSession, scope: str | None) -> str:
        """List `scope` into the store, page by page; the list's resourceVersion."""
        items: list[Mapping[str, Any]] = []
        version: str | None = None
        params = {"labelSelector": self._selector, "limit": str(PAGE)}
        while True:
            async with session.get(
                self._url(scope), params=params, headers=auth_headers(self._configuration)
            ) as reply:
                _check(reply, "list")
                page = json.loads(await reply.read())
            version = version or str(page["metadata"]["resourceVersion"])
            items.extend(page.get("items") or [])
            params["continue"] = page["metadata"].get("continue") or ""
            if not params["continue"]:
                break
        for change, pod in self.store.relist(scope, items):
            self._tell(change, pod)
        return version

    async def _watch(self, session: aiohttp.ClientSession, scope: str | None, version: str) -> str:
        """Follow the changes after `version` until the server ends the watch; the last
        version seen."""
        params = {
            "watch": "true",
            "labelSelector": self._selector,
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SERVER_TIMEOUT_SECONDS),  # then it resumes
        }
        async with session.get(
            self._url(scope), params=params, headers=auth_headers(self._configuration)
        ) as reply:
            _check(reply, "watch")
            pending = b""
            async for chunk in reply.content.iter_any():
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line.strip():
                        version = self._event(json.loads(line), version)
        return version

    def _event(self, event: Mapping[str, Any], version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == GONE:
                raise ExpiredError(obj.get("message") or "resource version expired")
            raise WatchError(f"watch error: {obj.get('message')}")
        meta = obj.get("metadata") or {}
        version = str(meta.get("resourceVersion") or version)
        if kind == DELETED:
            if self.store.drop(str(meta["uid"])) is not None:
                self._tell(DELETED, obj)
        elif kind in (ADDED, MODIFIED):
            change = self.store.put(obj)
            if change is not None:
                self._tell(change, obj)
        return version  # BOOKMARK: the version alone

    def _tell(self, change: str, pod: Mapping[str, Any]) -> None:
        # No callback failure stops the watch: the store is already up to date.
        try:
            self._on_change(change, str(pod["metadata"].get("namespace")), pod)
        except Exception:
            log.exception("pod %s: handling its change failed", pod["metadata"].get("name"))


def _check(reply: aiohttp.ClientResponse, verb: str) -> None:
    if reply.status == GONE:
        metrics.API_REQUESTS.labels(verb, "pods", metrics.ApiResult.EXPIRED).inc()
        raise ExpiredError(f"HTTP {GONE} on {verb}")
    if reply.status != 200:
        metrics.API_REQUESTS.labels(verb, "pods", metrics.ApiResult.ERROR).inc()
        raise WatchError(f"{verb} of pods: HTTP {reply.status}")
    metrics.API_REQUESTS.labels(verb, "pods", metrics.ApiResult.OK).inc()


def _named(scope: str | None) -> str:
    return f"namespace {scope}" if scope else "every namespace"
