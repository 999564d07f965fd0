"""The agent's filtering front (`spec.inference[].front`): the engine's public port, less
the routes only the agent may call.

An engine serves inference and its weight-update, development and memory routes on one
port, so a NetworkPolicy cannot admit clients to the one and keep them from the other.
With a front the engine listens on the pod's loopback; the agent reaches it there and
serves the engine's clients on `front.port`, forwarding every request (bodies and
replies streamed both ways, end-to-end headers kept) except those to the engine's
`PRIVATE_ROUTES`, which it answers 403 with an `ErrorResponse` saying why.

The decision (`refusal`) is pure. It reads the path as an engine could: percent-escapes
decoded until none is left, backslashes as slashes, dot segments resolved, empty
segments dropped, in lower case, and matches route prefixes on every method; the
request is forwarded with its target unchanged. `ExposureWatch` checks that the engine
does not also answer on the pod's IP, where the front would protect nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from weightsync.api.control import ErrorResponse, FrontStatus
from weightsync.api.engines import PRIVATE_ROUTES
from weightsync.api.reasons import ErrorCode
from weightsync.api.v1alpha1 import Engine

log = logging.getLogger(__name__)

FORWARDED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Hop-by-hop headers (RFC 9110 7.6.1) stay on their hop. `Expect` too: the front answers
# `100-continue` itself before it reads the body it forwards.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect",
    }
)  # fmt: skip
# More escapes than this are no path a client means, only an attempt to hide one.
MAX_DECODINGS = 3
CHUNK_BYTES = 1 << 16
CONNECT_TIMEOUT_SECONDS = 10.0
EXPOSURE_CHECK_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the front answers a request itself, and with which status."""

    status: int
    error: str
    detail: str


UPGRADE_REFUSED = Refusal(
    501,
    ErrorCode.UPGRADE_NOT_FORWARDED,
    "protocol upgrades (WebSocket) are not forwarded to the engine",
)


def normalized_path(target: str) -> str | None:
    """The path an engine could route the raw request target `target` to, in lower case;
    None for a target that is no path (absolute-form, `*`) or is escaped too deeply."""
    if not target.startswith("/"):
        return None
    path = target.split("?", 1)[0].split("#", 1)[0]
    for _ in range(MAX_DECODINGS + 1):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    else:
        return None
    segments: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        if segment == "..":
            if segments:
                segments.pop()
        elif segment not in ("", "."):
            segments.append(segment)
    return "/" + "/".join(segments).lower()


def refusal(engine: Engine, method: str, target: str) -> Refusal | None:
    """Why the front must not forward `method target` to `engine` (None: forward it)."""
    if method.upper() not in FORWARDED_METHODS:
        return Refusal(
            405, ErrorCode.METHOD_NOT_FORWARDED, f"{method} is not forwarded to the engine"
        )
    path = normalized_path(target)
    if path is None:
        return Refusal(400, ErrorCode.BAD_TARGET, "the request target is not a plain path")
    for routes in PRIVATE_ROUTES[engine]:
        if any(path.startswith(prefix) for prefix in routes.prefixes):
            return Refusal(
                403,
                ErrorCode.PRIVATE_ROUTE,
                f"{path} is one of {routes.what}, which only the pod's weightsync agent calls",
            )
    return None


def end_to_end(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    """`headers` less the hop-by-hop ones and any that `Connection` names."""
    connection = headers.getall("Connection", [])
    named = {token.strip().lower() for value in connection for token in value.split(",")}
    dropped = HOP_BY_HOP | named
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)


def _answer(refused: Refusal) -> web.Response:
    body = ErrorResponse(error=refused.error, detail=refused.detail).model_dump_json()
    return web.Response(status=refused.status, text=body, content_type="application/json")


async def _chunks(request: web.Request) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_chunked(CHUNK_BYTES):
        yield chunk


class Front:
    """Forwards the engine's clients to `upstream` (the engine on the pod's loopback)."""

    def __init__(self, engine: Engine, upstream: str, port: int) -> None:
        self.engine = engine
        self.upstream = upstream.rstrip("/")
        self.port = port
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # Every client's requests at once: no pool limit, no overall timeout (a
                # generation streams for as long as it takes), bodies passed as encoded.
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_SECONDS),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        refused = refusal(self.engine, request.method, request.raw_path)
        if refused is not None:
            log.warning(
                "front: refused %s %s from %s: %s",
                request.method,
                request.raw_path[:200],
                request.remote,
                refused.detail,
            )
            return _answer(refused)
        if "Upgrade" in request.headers:
            return _answer(UPGRADE_REFUSED)
        url = URL(self.upstream + request.raw_path, encoded=True)
        body = _chunks(request) if request.body_exists else None
        try:
            upstream = await self.session().request(
                request.method,
                url,
                headers=end_to_end(request.headers),
                data=body,
                allow_redirects=False,
            )
        except aiohttp.ClientError as exc:
            return _answer(Refusal(502, ErrorCode.ENGINE_UNREACHABLE, f"{self.upstream}: {exc}"))
        async with upstream:
            reply = web.StreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers=end_to_end(upstream.headers),
            )
            await reply.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    try:
                        await reply.write(chunk)
                    except ConnectionResetError:
                        return reply  # the client left; closing the engine's reply tells it
            except aiohttp.ClientError as exc:
                # The engine broke off mid-reply: so must the front, or a cut stream would
                # look complete to the client.
                log.warning("front: the engine's reply to %s broke off: %s", request.path, exc)
                if request.transport is not None:
                    request.transport.abort()
                return reply
            await reply.write_eof()
        return reply

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        return app


async def reachable(host: str, port: int, timeout_seconds: float = 2.0) -> bool:
    """Whether something accepts TCP connections at `host:port`."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_seconds)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class ExposureWatch:
    """Whether the engine behind a front answers on the pod's IP too, checked now and then:
    the engine starts after the sidecar and may restart with other flags."""

    def __init__(self, front: Front, pod_ip: str, engine_port: int) -> None:
        self.front = front
        self.pod_ip = pod_ip
        self.engine_port = engine_port
        self.exposed: bool | None = None  # None: the engine answers nowhere yet

    async def check(self) -> bool | None:
        exposed = await reachable(self.pod_ip, self.engine_port)
        if not exposed and not await reachable("127.0.0.1", self.engine_port):
            exposed_now: bool | None = None
        else:
            exposed_now = exposed
        if exposed_now and not self.exposed:
            host = f"[{self.pod_ip}]" if ":" in self.pod_ip else self.pod_ip
            log.warning(
                "front: the engine answers on the pod's IP at %s:%d, so every pod that"
                " reaches it can call its update routes and the front on port %d protects"
                " nothing; start the engine on the pod's loopback (--host 127.0.0.1)",
                host,
                self.engine_port,
                self.front.port,
            )
        elif exposed_now is False and self.exposed is not False:
            log.info("front: the engine answers on the pod's loopback only")
        self.exposed = exposed_now
        return exposed_now

    async def run_forever(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(EXPOSURE_CHECK_SECONDS)

    def status(self) -> FrontStatus:
        return FrontStatus(port=self.front.port, engine_exposed=self.exposed)
