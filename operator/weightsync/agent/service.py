"""The agent: what the control API and the Publisher socket act on.

It owns the parts and their lifecycle: plans and generations, the source's loop (the
Publisher's rounds, `agent.source_loop`) or a sink's (`agent.sink_loop`), the round
book both write (`agent.round_book`), recovery requests, status and metrics. The HTTP
listeners are in `agent.control_api`, the Publisher's socket protocol in
`agent.handoff_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import torch
from yarl import URL

from weightsync.agent.engine_adapter import build_adapter
from weightsync.agent.engine_watch import EngineWatch
from weightsync.agent.front import ExposureWatch, Front
from weightsync.agent.generations import Generations, PlanRejectedError
from weightsync.agent.holder import Holder
from weightsync.agent.local_reload import LocalReload
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.recovery import Recovery, RecoveryFailed
from weightsync.agent.round_book import RoundBook
from weightsync.agent.settings import AgentSettings
from weightsync.agent.sink_loop import SinkLoop
from weightsync.agent.slot_pool import SlotPool, slot_devices
from weightsync.agent.source_loop import SourceLoop
from weightsync.api.control import (
    AgentStatus,
    MembershipPlan,
    PlanAccepted,
    RecoverRequest,
    RecoveryStatus,
    RecoveryTransport,
)
from weightsync.api.protocol import PROTOCOL_VERSION
from weightsync.api.reasons import RecoveryFailureReason
from weightsync.api.v1alpha1 import Role
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.engines.base import EngineAdapter
from weightsync.transfer.p2p import Endpoints, mooncake_available
from weightsync.transfer.p2p_protocol import Resolution, probe_rdma, resolve_protocol

log = logging.getLogger(__name__)


def resolve_transport(settings: AgentSettings) -> Resolution:
    """The P2P protocol this agent uses, from what its container can open; logged, since
    a protocol that silently differs from the one asked for is a slow mystery later."""
    resolution = resolve_protocol(
        settings.p2p_protocol, probe_rdma(), mooncake_available(), settings.p2p_device_names
    )
    if resolution.usable:
        log.info("P2P recovery protocol: %s (%s)", resolution.protocol, resolution.detail)
    else:
        log.error(
            "P2P recovery protocol %s cannot work here, so this agent neither holds nor pulls: %s",
            resolution.protocol,
            resolution.detail,
        )
    return resolution


class Agent:
    def __init__(self, settings: AgentSettings, transport: Resolution | None = None) -> None:
        """`transport`: the resolved P2P protocol (default: `resolve_transport`)."""
        self.settings = settings
        self.transport = transport or resolve_transport(settings)
        self.device = torch.device(settings.device)
        self.metrics = AgentMetrics(settings.role.label)
        self.generations = Generations(self.device, self.metrics)
        devices = [self.device]
        if settings.role == Role.SINK:  # a copy of each slot on each of its engine's devices
            visible = torch.cuda.device_count() if self.device.type == "cuda" else 0
            devices = slot_devices(settings.device, settings.engine_devices, visible)
        self.pool = SlotPool(devices, str(settings.shm_dir))
        self.adapter: EngineAdapter | None = build_adapter(settings)
        self.watch = (
            EngineWatch(self.adapter, loaded_by_peer=settings.engine_loaded_by_peer)
            if self.adapter is not None
            else None
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.front: Front | None = None
        self.exposure: ExposureWatch | None = None
        if settings.front_port and settings.engine is not None:
            self.front = Front(settings.engine, settings.engine_url, settings.front_port)
            engine_port = URL(settings.engine_url).port or 80
            self.exposure = ExposureWatch(self.front, settings.pod_ip(), engine_port)
        self.endpoints = Endpoints(settings.p2p_address, settings.p2p_devices)
        self.holder = Holder(
            self.device,
            self.endpoints,
            self.transport.protocol,
            self.metrics,
            enabled=self._holds(plan_asks=False),
            yield_to_votes=not settings.measure_holder_copies_through_votes,
        )
        self.book = RoundBook(self.holder, self.metrics, self.watch)
        self.recovery: Recovery | None = None
        if settings.role == Role.SINK and self.adapter is not None:
            self.recovery = Recovery(
                pool=self.pool,
                adapter=self.adapter,
                endpoints=self.endpoints,
                metrics=self.metrics,
                token=settings.bearer_token,
                depth=self._pipeline_depth,
                engine_timeout_seconds=settings.engine_timeout_seconds,
                on_recovered=self.book.recovered,
            )
        self.source: SourceLoop | None = None
        if settings.role == Role.SOURCE:
            self.source = SourceLoop(
                self.generations,
                self.pool,
                self.holder,
                device=self.device,
                own_engine=self.adapter,
                engine_timeout_seconds=settings.engine_timeout_seconds,
                pod=settings.pod_name,
                book=self.book,
            )

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.exposure is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._supervise(self.exposure.run_forever), name="front-exposure"
                )
            )
        if self.watch is not None:
            self._tasks.append(
                asyncio.create_task(self._supervise(self.watch.run_forever), name="engine-watch")
            )
        if self.source is not None:  # a Colocated plan's engine, reloaded when it needs
            reload = LocalReload(self.source, self.metrics)
            self._tasks.append(
                asyncio.create_task(self._supervise(reload.run_forever), name="local-reload")
            )
        if self.settings.role == Role.SINK and self.adapter is not None:
            loop = SinkLoop(
                self.generations,
                self.pool,
                self.adapter,
                engine_timeout_seconds=self.settings.engine_timeout_seconds,
                holder=self.holder,
                book=self.book,
                before_round=self.recovery.yield_to_round if self.recovery else None,
            )
            self._tasks.append(asyncio.create_task(self._supervise(loop.run_forever), name="sink"))

    async def _supervise(self, body: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s crashed; restarting in 1 s", asyncio.current_task())
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.recovery is not None:
            await self.recovery.close()
        await self.generations.close()
        if self.adapter is not None:
            await self.adapter.close()
        if self.front is not None:
            await self.front.close()
        if self.source is not None:
            await self.source.close()
        self.pool.close()
        self.holder.close()
        self.endpoints.close()

    # ---------------------------------------------------------------- control API
    def apply_plan(self, plan: MembershipPlan) -> PlanAccepted:
        if plan.me.role != self.settings.role:
            raise PlanRejectedError(
                f"rank {plan.rank} is a {plan.me.role}, this agent a {self.settings.role}"
            )
        generation = self.generations.apply_plan(plan)
        self.holder.set_enabled(self._holds(plan_asks=plan.holder))
        return PlanAccepted(
            generation=generation.number, rank=plan.rank, world_size=plan.world_size
        )

    def _holds(self, *, plan_asks: bool) -> bool:
        """A copy no puller can read (its protocol cannot work here) is not worth holding."""
        return self.transport.usable and (self.settings.holds_by_default or plan_asks)

    async def status(self) -> AgentStatus:
        """Answered from what the agent knows: the engine's last polled health, never a
        call to a possibly frozen engine."""
        engine = self.watch.status() if self.watch is not None else None
        active = self.generations.active() or self.generations.newest_usable()
        plan = self.generations.newest_plan()
        return AgentStatus(
            pod=self.settings.pod_name,
            role=self.settings.role,
            generation=active.number if active else None,
            warm=active is not None and active.usable,
            version=self.book.version,
            lineage=self.book.lineage,
            round_in_progress=self.book.round_in_progress,
            generations=self.generations.statuses(),
            engine=engine,
            last_round=self.book.last_round,
            recovery=self.recovery.status() if self.recovery is not None else None,
            holding=self.holder.held_version,
            holding_lineage=self.holder.held_lineage,
            local_engine=plan.local_engine.pod if plan and plan.local_engine else None,
            recovery_transport=RecoveryTransport(
                protocol=self.transport.protocol,
                usable=self.transport.usable,
                detail=self.transport.detail,
            ),
            front=self.exposure.status() if self.exposure is not None else None,
            protocol_version=PROTOCOL_VERSION,
        )

    # ---------------------------------------------------------------- recovery
    def _pipeline_depth(self) -> int:
        plan = self.generations.newest_plan()
        return plan.transfer.pipeline_depth if plan else 2

    def _can_pull(self, protocol: RecoveryProtocol) -> bool:
        """TCP needs only the transfer engine, so an agent resolved to RDMA pulls over TCP
        from TCP holders too; RDMA needs this agent to have resolved to it."""
        usable = self.transport.usable
        return usable and protocol in (self.transport.protocol, RecoveryProtocol.TCP)

    def start_recovery(self, request: RecoverRequest) -> RecoveryStatus:
        """Start pulling from holders; refuse while a round uses the slots and the engine.

        A member of a warm generation recovers too (its engine restarted in place): a
        round that starts meanwhile stops the recovery and brings the engine current.
        """
        if self.recovery is None:
            raise RecoveryFailed(
                RecoveryFailureReason.NOT_A_SINK, "only a sink agent with an engine recovers"
            )
        if not self._can_pull(request.protocol):
            raise RecoveryFailed(
                RecoveryFailureReason.PROTOCOL_UNAVAILABLE,
                f"cannot pull over {request.protocol}: this agent's P2P protocol is"
                f" {self.transport.protocol} ({self.transport.detail})",
            )
        if self.book.round_in_progress:
            raise RecoveryFailed(RecoveryFailureReason.BUSY, "a round is in progress")
        if self.watch is not None and self.watch.vouched() is not None:
            served = self.watch.vouched()
            if (
                served is not None
                and served.version >= request.version
                and (not request.lineage or served.lineage == request.lineage)
            ):
                raise RecoveryFailed(
                    RecoveryFailureReason.NOT_BEHIND,
                    f"the engine serves version {served.version} already",
                )
        return self.recovery.start(request)
