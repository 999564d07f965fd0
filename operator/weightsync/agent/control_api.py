"""The agent's HTTP listeners: the control API (bearer token on every route), metrics,
and, on a source, the Publisher's Unix socket; `serve` runs them around an `Agent`.

Routes (messages in `weightsync.api.control`):
* `PUT /v1/plan`   `MembershipPlan` -> 202 `PlanAccepted`; forms + pre-warms in the background
* `GET /v1/status` -> `AgentStatus`; `?with=a,b` adds those of `STATUS_ADDITIONS`
* `GET /v1/holding` -> `Holding` (the version held for P2P pulls), 404 when none
* `POST /v1/recover` `RecoverRequest` -> 202 `RecoveryStatus`; pulls in the background
* `GET /v1/engine/ready` -> 200 or 503 with the reason: the engine container's readiness
  probe (`agent.engine_ready`), the one route without a token (the kubelet has none)
Every request may carry the operator's protocol version (`api.protocol.HEADER`; none is
the oldest): a newer operator's unknown request fields are ignored, and the status leaves
out the fields the operator's version lacks (`api.protocol`'s skew policy).
Metrics: `GET /metrics` on the metrics port (no token: Prometheus scrapes it).
A sink with a front (`agent.front`) serves the engine's clients on the front's port, on
every interface.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from weightsync.agent.engine_ready import engine_ready
from weightsync.agent.generations import PlanRejectedError
from weightsync.agent.handoff_server import serve_publisher
from weightsync.agent.recovery import RecoveryFailed
from weightsync.agent.service import Agent
from weightsync.api.control import (
    STATUS_ADDITIONS,
    ErrorResponse,
    MembershipPlan,
    RecoverRequest,
)
from weightsync.api.engine_probe import ENGINE_READY_PATH
from weightsync.api.protocol import HEADER, PROTOCOL_VERSION, for_peer, parse_from, sender_version
from weightsync.api.reasons import ErrorCode

log = logging.getLogger(__name__)

AGENT_KEY: web.AppKey[Agent] = web.AppKey("agent")
# Unknown fields already logged (`_parse`): a newer operator sends them on every request.
IGNORED_KEY: web.AppKey[set[str]] = web.AppKey("ignored", set[str])

MessageT = TypeVar("MessageT", bound=BaseModel)


class _BadRequestError(Exception):
    """A request the agent answers 400 to: `error` and `detail` of its `ErrorResponse`."""

    def __init__(self, error: str, detail: str) -> None:
        super().__init__(detail)
        self.error = error
        self.detail = detail


@web.middleware
async def _auth(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    if request.path == ENGINE_READY_PATH:  # the kubelet's probe: ready or not, and why
        return await handler(request)
    expected = f"Bearer {request.app[AGENT_KEY].settings.bearer_token()}"
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        return _error(401, ErrorCode.UNAUTHORIZED, "missing or wrong bearer token")
    return await handler(request)


def _error(status: int, error: str, detail: str) -> web.Response:
    body = ErrorResponse(error=error, detail=detail).model_dump_json()
    return web.Response(status=status, text=body, content_type="application/json")


def _sender(request: web.Request) -> int:
    """The requesting operator's protocol version (absent: the oldest)."""
    try:
        return sender_version(request.headers.get(HEADER))
    except ValueError as exc:
        raise _BadRequestError(ErrorCode.INVALID_REQUEST, f"header {HEADER}: {exc}") from exc


async def _parse(request: web.Request, model: type[MessageT], error: str) -> MessageT:
    """The request's body as `model`; a newer operator's unknown fields ignored, logged
    once per field (it sends them on every request)."""
    sender = _sender(request)
    try:
        message, ignored = parse_from(model, await request.read(), sender)
    except ValidationError as exc:
        raise _BadRequestError(error, str(exc)) from exc
    seen = request.app[IGNORED_KEY]
    new = [f"{model.__name__}.{path}" for path in ignored if f"{model.__name__}.{path}" not in seen]
    if new:
        seen.update(new)
        log.info(
            "ignoring fields the operator's protocol version %d adds (this agent's is %d): %s",
            sender, PROTOCOL_VERSION, ", ".join(new),
        )  # fmt: skip
    return message


async def put_plan(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    try:
        plan = await _parse(request, MembershipPlan, ErrorCode.INVALID_PLAN)
    except _BadRequestError as exc:
        return _error(400, exc.error, exc.detail)
    try:
        accepted = agent.apply_plan(plan)
    except PlanRejectedError as exc:
        return _error(409, ErrorCode.PLAN_REJECTED, str(exc))
    return web.Response(
        status=202, text=accepted.model_dump_json(), content_type="application/json"
    )


async def get_status(request: web.Request) -> web.Response:
    try:
        sender = _sender(request)
    except _BadRequestError as exc:
        return _error(400, exc.error, exc.detail)
    status = await request.app[AGENT_KEY].status()
    asked = {name for value in request.query.getall("with", []) for name in value.split(",")}
    # An operator that did not ask for a field, or whose version lacks it, may not know
    # it: its parser would refuse the whole answer.
    unasked = frozenset(name for name in STATUS_ADDITIONS if name not in asked)
    body = for_peer(status, sender, exclude=unasked).json()
    return web.Response(text=body, content_type="application/json")


async def get_holding(request: web.Request) -> web.Response:
    try:
        holding = await request.app[AGENT_KEY].holder.holding()
    except TimeoutError:
        return _error(
            503, ErrorCode.CHECKSUMS_PENDING, "the held version's checksums are not ready"
        )
    if holding is None:
        return _error(404, ErrorCode.NOT_HOLDING, "this agent holds no version")
    return web.Response(text=holding.model_dump_json(), content_type="application/json")


async def post_recover(request: web.Request) -> web.Response:
    try:
        recover = await _parse(request, RecoverRequest, ErrorCode.INVALID_REQUEST)
    except _BadRequestError as exc:
        return _error(400, exc.error, exc.detail)
    try:
        started = request.app[AGENT_KEY].start_recovery(recover)
    except RecoveryFailed as exc:
        return _error(409, exc.reason, str(exc))
    return web.Response(status=202, text=started.model_dump_json(), content_type="application/json")


async def get_engine_ready(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    # The agent listens on the pod's IP (`http_host`): the kubelet's host for a probe.
    settings = agent.settings
    ready, why = await engine_ready(agent.watch, settings.engine_probe, settings.http_host)
    return web.Response(status=200 if ready else 503, text=why + "\n")


async def get_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[AGENT_KEY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_control_app(agent: Agent) -> web.Application:
    app = web.Application(middlewares=[_auth])
    app[AGENT_KEY] = agent
    app[IGNORED_KEY] = set()
    app.router.add_put("/v1/plan", put_plan)
    app.router.add_get("/v1/status", get_status)
    app.router.add_get("/v1/holding", get_holding)
    app.router.add_post("/v1/recover", post_recover)
    app.router.add_get(ENGINE_READY_PATH, get_engine_ready)
    return app


def make_metrics_app(agent: Agent) -> web.Application:
    app = web.Application()
    app[AGENT_KEY] = agent
    app.router.add_get("/metrics", get_metrics)
    return app


async def serve(agent: Agent, stop: asyncio.Event) -> None:
    """Run the control API, the metrics listener and (source) the Publisher socket."""
    settings = agent.settings
    runners = [web.AppRunner(make_control_app(agent), access_log=None)]
    sites: list[tuple[web.AppRunner, str | None, int]] = [
        (runners[0], settings.http_host, settings.http_port)
    ]
    if settings.metrics_port:
        metrics_runner = web.AppRunner(make_metrics_app(agent), access_log=None)
        runners.append(metrics_runner)
        sites.append((metrics_runner, settings.http_host, settings.metrics_port))
    if agent.front is not None:
        front_runner = web.AppRunner(agent.front.app(), access_log=None)
        runners.append(front_runner)
        # Every interface: the engine's clients may come through the pod IP or a port-forward.
        sites.append((front_runner, None, agent.front.port))
    server: asyncio.base_events.Server | None = None
    try:
        for runner, host, port in sites:
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
        if agent.source is not None:
            source = agent.source
            settings.socket.parent.mkdir(parents=True, exist_ok=True)
            settings.socket.unlink(missing_ok=True)
            server = await asyncio.start_unix_server(
                lambda r, w: serve_publisher(source, r, w), path=str(settings.socket)
            )
        agent.start()
        log.info(
            "agent %s (%s) serving on %s:%d",
            settings.pod_name,
            settings.role.label,
            settings.http_host,
            settings.http_port,
        )
        await stop.wait()
    finally:
        if server is not None:
            server.close()
            settings.socket.unlink(missing_ok=True)
        await agent.close()
        for runner in runners:
            await runner.cleanup()
