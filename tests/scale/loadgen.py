"""A load generator for the operator: it stands in for the agents of many pods at once.

It is not an agent: no process groups, no engines, no weights. It answers the agents'
control API (`PUT /v1/plan`, `GET /v1/status`, `POST /v1/recover`) for every pod IP on
one port, with the agents' own messages from `weightsync.api.control`, so what the
operator sends and reads here is exactly what real agents would parse and answer (a
change to those models changes this too). KWOK pods get loopback addresses
(127.x.y.z), and a socket bound to the wildcard address receives connections to all of
them: the address a request arrived at says which pod's agent it is for, as the harness
announces it from its pod watch (`POST /addresses`). Stand-ins are kept by pod: under load
KWOK gives some pods a second address and hands a freed one to another pod, which no
real pod's agent sees (it keeps its pod's address for life).

What the stand-ins do, as the operator sees it:
* a plan's generation is `forming` for `--warm-seconds`, then warm; a round (the
  harness's `publish`) runs in the source's newest warm one, which turns `active` on
  every stand-in holding it while older ones retire, as the agents' switch notice
  does (one generation per plan, like the agents; until the next round a warm
  generation stays warm beside the active one);
* a recovery is `running` for `--recover-seconds`, then `done`, the engine serving the
  version asked for;
* the source's version, the engines' versions and slow answers are set by the harness
  through a small admin API on another port (127.0.0.1 only):
  `POST /addresses {ip: pod, ...}` (those pods hold those addresses now), `POST /source
  {"pod"}`, `POST /publish {"version", "sinks"}` (without sinks: a
  version no engine got, as after a round no sink took part in, so its report names
  no generation; an ok round in theirs would vouch that they committed it),
  `POST /load {"version"}` (every engine), `POST /slow {"seconds", "delay"}`,
  `GET /stats` (plan bytes per generation, requests by route, requests that waited
  for their address to be announced).

    python -m tests.scale.loadgen --port 8470 --admin-port 8471
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from weightsync.api.control import (
    AgentStatus,
    EngineStatus,
    ErrorResponse,
    GenerationState,
    GenerationStatus,
    MembershipPlan,
    PlanAccepted,
    RecoverRequest,
    RecoveryState,
    RecoveryStatus,
    RoundReport,
)
from weightsync.api.v1alpha1 import Role

log = logging.getLogger("weightsync.loadgen")

LINEAGE = "loadgen"
KEEP_GENERATIONS = 4  # retired ones kept for the status, as the agents do
# How long a request to an address the harness has not announced yet waits for it (the
# operator and the harness learn a new pod's address from their own watches).
ADDRESS_WAIT_SECONDS = 5.0


@dataclass
class PlannedGeneration:
    number: int
    rank: int
    world_size: int
    warm_at: float  # monotonic time the stand-in reports it warm from


@dataclass
class StandIn:
    """One pod's agent, as far as the operator can tell."""

    pod: str
    role: Role
    generations: dict[int, PlannedGeneration] = field(default_factory=dict)
    engine_version: int | None = None  # sinks: what the engine serves
    recovery: RecoveryStatus | None = None
    recovery_done_at: float = 0.0

    def newest_warm(self, now: float) -> int | None:
        return max((n for n, g in self.generations.items() if now >= g.warm_at), default=None)

    def generation_states(self, now: float, active: int | None) -> list[GenerationStatus]:
        """`active`: the generation the last round ran in (older ones were switched away)."""
        states = []
        for number in sorted(self.generations):
            planned = self.generations[number]
            if active is not None and number < active:
                state = GenerationState.RETIRED
            elif number == active:
                state = GenerationState.ACTIVE
            else:
                state = GenerationState.FORMING if now < planned.warm_at else GenerationState.WARM
            states.append(
                GenerationStatus(
                    generation=number,
                    state=state,
                    rank=planned.rank,
                    world_size=planned.world_size,
                    prewarm_millis=None if state is GenerationState.FORMING else 1,
                )
            )
        return states


@dataclass
class Stats:
    plan_bytes: Counter[int] = field(default_factory=Counter)  # by generation
    plans: Counter[int] = field(default_factory=Counter)  # by generation
    requests: Counter[str] = field(default_factory=Counter)  # by route
    slowed: int = 0  # requests answered late on purpose
    # Requests that arrived before the harness announced their address: how many waited
    # (and how long in all, the longest), and how many gave up (503).
    address_waits: int = 0
    address_wait_seconds: float = 0.0
    address_wait_max: float = 0.0
    unannounced: int = 0


class LoadGenerator:
    """Every stand-in agent, and what the harness made of them."""

    def __init__(self, warm_seconds: float, recover_seconds: float) -> None:
        self.warm_seconds = warm_seconds
        self.recover_seconds = recover_seconds
        self.stand_ins: dict[str, StandIn] = {}  # by pod
        self.addresses: dict[str, str] = {}  # ip -> the pod that holds it now
        self.announced = asyncio.Condition()
        self.source: str | None = None  # the trainer's pod
        self.version: int | None = None  # the source's last committed version
        self.round_generation: int | None = None  # the generation the last round ran in
        self.last_round: RoundReport | None = None
        self.slow_until = 0.0
        self.slow_delay = 0.0
        self.stats = Stats()

    def stand_in(self, pod: str) -> StandIn:
        found = self.stand_ins.get(pod)
        if found is None:
            role = Role.SOURCE if pod == self.source else Role.SINK
            found = self.stand_ins[pod] = StandIn(pod=pod, role=role)
        return found

    async def at(self, ip: str) -> StandIn | None:
        """The stand-in of the pod that holds `ip`, once the harness has announced it."""
        if ip not in self.addresses:
            began = time.monotonic()
            async with self.announced:
                try:
                    await asyncio.wait_for(
                        self.announced.wait_for(lambda: ip in self.addresses),
                        ADDRESS_WAIT_SECONDS,
                    )
                except TimeoutError:
                    self.stats.unannounced += 1
                    return None
                finally:
                    waited = time.monotonic() - began
                    self.stats.address_waits += 1
                    self.stats.address_wait_seconds += waited
                    self.stats.address_wait_max = max(self.stats.address_wait_max, waited)
        return self.stand_in(self.addresses[ip])

    async def address(self, pods: dict[str, str]) -> None:
        """`pods`: ip -> the pod that holds it now."""
        async with self.announced:
            self.addresses.update(pods)
            self.announced.notify_all()

    async def maybe_slow(self) -> None:
        """Answer late while the harness asked for slow agents (past the poll timeout)."""
        if time.monotonic() < self.slow_until:
            self.stats.slowed += 1
            await asyncio.sleep(self.slow_delay)

    # -- the control API, as the agents serve it ----------------------------------------

    def status(self, agent: StandIn) -> AgentStatus:
        now = time.monotonic()
        self._settle_recovery(agent, now)
        generations = agent.generation_states(now, self.round_generation)
        # As the agents answer: the active generation, else the newest warm one.
        usable = (GenerationState.ACTIVE, GenerationState.WARM)
        active = next((g for g in generations if g.state is GenerationState.ACTIVE), None) or next(
            (g for g in reversed(generations) if g.state in usable), None
        )
        source = agent.role is Role.SOURCE
        engine = None
        if not source:
            engine = EngineStatus(
                healthy=True,
                version=agent.engine_version,
                lineage=LINEAGE if agent.engine_version is not None else None,
                incarnation=f"{agent.pod}-1",
                reported_version=agent.engine_version,
            )
        version = self.version if source else agent.engine_version
        return AgentStatus(
            pod=agent.pod,
            role=agent.role,
            generation=active.generation if active else None,
            warm=active is not None,
            version=version,
            lineage=LINEAGE if version is not None else None,
            round_in_progress=False,
            generations=generations,
            engine=engine,
            last_round=self.last_round if source else None,
            recovery=agent.recovery,
            holding=self.version if source else None,
            holding_lineage=LINEAGE if source and self.version is not None else None,
        )

    def apply_plan(self, agent: StandIn, plan: MembershipPlan, nbytes: int) -> PlanAccepted:
        self.stats.plan_bytes[plan.generation] += nbytes
        self.stats.plans[plan.generation] += 1
        agent.generations[plan.generation] = PlannedGeneration(
            plan.generation, plan.rank, plan.world_size, time.monotonic() + self.warm_seconds
        )
        retired = [n for n in sorted(agent.generations) if n < (self.round_generation or 0)]
        for number in retired[:-KEEP_GENERATIONS]:
            del agent.generations[number]
        return PlanAccepted(generation=plan.generation, rank=plan.rank, world_size=plan.world_size)

    def start_recovery(self, agent: StandIn, request: RecoverRequest) -> RecoveryStatus:
        agent.recovery = RecoveryStatus(
            state=RecoveryState.RUNNING,
            version=request.version,
            lineage=request.lineage,
            started_at_unix_millis=int(time.time() * 1000),
        )
        agent.recovery_done_at = time.monotonic() + self.recover_seconds
        return agent.recovery

    def _settle_recovery(self, agent: StandIn, now: float) -> None:
        recovery = agent.recovery
        if recovery is None or recovery.state is not RecoveryState.RUNNING:
            return
        if now < agent.recovery_done_at:
            return
        agent.engine_version = recovery.version
        agent.recovery = recovery.model_copy(
            update={
                "state": RecoveryState.DONE,
                "duration_millis": round(self.recover_seconds * 1000),
                "holders_used": ["http://loadgen"],
            }
        )

    # -- what the harness drives ----------------------------------------------------------

    def publish(self, version: int, *, sinks: bool) -> None:
        """The trainer's round committed `version` (on every engine too when `sinks`)."""
        if sinks:
            self.load(version)
        source = self.stand_ins.get(self.source or "")
        if source is not None:
            self.round_generation = source.newest_warm(time.monotonic())
        self.version = version
        self.last_round = RoundReport(
            version=version,
            generation=self.round_generation if sinks else None,
            ok=True,
            duration_millis=50,
            bytes=1 << 30,
            bandwidth_bytes_per_second=20 << 30,
            finished_at_unix_millis=int(time.time() * 1000),
            lineage=LINEAGE,
        )

    def load(self, version: int) -> None:
        for agent in self.stand_ins.values():
            if agent.role is Role.SINK:
                agent.engine_version = version


GEN_KEY: web.AppKey[LoadGenerator] = web.AppKey("loadgen")


def _error(status: int, error: str, detail: str) -> web.Response:
    body = ErrorResponse(error=error, detail=detail).model_dump_json()
    return web.Response(status=status, text=body, content_type="application/json")


async def _agent_of(request: web.Request) -> StandIn:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    ip = str(sockname[0]) if sockname else request.host.rsplit(":", 1)[0]
    found = await request.app[GEN_KEY].at(ip)
    if found is None:  # as an agent that is not listening yet
        raise web.HTTPServiceUnavailable(text=f"no pod announced at {ip}")
    return found


@web.middleware
async def _bearer(request: web.Request, handler: Any) -> web.StreamResponse:
    # The stand-ins cannot know the operator's key; they only insist that it sends one.
    if not request.headers.get("Authorization", "").startswith("Bearer "):
        return _error(401, "unauthorized", "missing bearer token")
    gen = request.app[GEN_KEY]
    gen.stats.requests[f"{request.method} {request.path}"] += 1
    await gen.maybe_slow()
    response: web.StreamResponse = await handler(request)
    return response


async def _put_plan(request: web.Request) -> web.Response:
    raw = await request.read()
    try:
        plan = MembershipPlan.model_validate_json(raw)
    except ValidationError as error:
        return _error(400, "invalid_plan", str(error))
    accepted = request.app[GEN_KEY].apply_plan(await _agent_of(request), plan, len(raw))
    return web.json_response(text=accepted.model_dump_json(), status=202)


async def _get_status(request: web.Request) -> web.Response:
    status = request.app[GEN_KEY].status(await _agent_of(request))
    return web.json_response(text=status.model_dump_json())


async def _post_recover(request: web.Request) -> web.Response:
    try:
        recover = RecoverRequest.model_validate_json(await request.read())
    except ValidationError as error:
        return _error(400, "invalid_request", str(error))
    started = request.app[GEN_KEY].start_recovery(await _agent_of(request), recover)
    return web.json_response(text=started.model_dump_json(), status=202)


def control_app(gen: LoadGenerator) -> web.Application:
    app = web.Application(middlewares=[_bearer])
    app[GEN_KEY] = gen
    app.router.add_put("/v1/plan", _put_plan)
    app.router.add_get("/v1/status", _get_status)
    app.router.add_post("/v1/recover", _post_recover)
    return app


def admin_app(gen: LoadGenerator) -> web.Application:
    async def source(request: web.Request) -> web.Response:
        gen.source = str((await request.json())["pod"])
        gen.stand_in(gen.source).role = Role.SOURCE
        return web.json_response({})

    async def addresses(request: web.Request) -> web.Response:
        body = await request.json()
        await gen.address({str(ip): str(pod) for ip, pod in body.items()})
        return web.json_response({})

    async def publish(request: web.Request) -> web.Response:
        body = await request.json()
        gen.publish(int(body["version"]), sinks=bool(body.get("sinks", True)))
        return web.json_response({})

    async def load(request: web.Request) -> web.Response:
        gen.load(int((await request.json())["version"]))
        return web.json_response({})

    async def slow(request: web.Request) -> web.Response:
        body = await request.json()
        gen.slow_delay = float(body["delay"])
        gen.slow_until = time.monotonic() + float(body["seconds"])
        return web.json_response({})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "plan_bytes": {str(k): v for k, v in gen.stats.plan_bytes.items()},
                "plans": {str(k): v for k, v in gen.stats.plans.items()},
                "requests": dict(gen.stats.requests),
                "slowed": gen.stats.slowed,
                "address_waits": gen.stats.address_waits,
                "address_wait_seconds": gen.stats.address_wait_seconds,
                "address_wait_max": gen.stats.address_wait_max,
                "unannounced": gen.stats.unannounced,
                "stand_ins": len(gen.stand_ins),
            }
        )

    app = web.Application()
    app.router.add_post("/source", source)
    app.router.add_post("/publish", publish)
    app.router.add_post("/load", load)
    app.router.add_post("/slow", slow)
    app.router.add_post("/addresses", addresses)
    app.router.add_get("/stats", stats)
    return app


async def serve(args: argparse.Namespace) -> None:
    gen = LoadGenerator(args.warm_seconds, args.recover_seconds)
    control = web.AppRunner(control_app(gen), access_log=None)
    admin = web.AppRunner(admin_app(gen), access_log=None)
    await control.setup()
    await admin.setup()
    # The wildcard address: KWOK's pod IPs are loopback addresses, one per pod.
    await web.TCPSite(control, "0.0.0.0", args.port, backlog=4096).start()
    await web.TCPSite(admin, "127.0.0.1", args.admin_port).start()
    log.info("load generator: agents on port %d, admin on 127.0.0.1:%d", args.port, args.admin_port)
    try:
        await asyncio.Event().wait()
    finally:
        await control.cleanup()
        await admin.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the agents' control port")
    parser.add_argument("--admin-port", type=int, required=True)
    parser.add_argument("--warm-seconds", type=float, default=0.5)
    parser.add_argument("--recover-seconds", type=float, default=0.5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
