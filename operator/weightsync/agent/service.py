"""The agent: what the control API, the Publisher socket and the sink loop act on.

Plans and generations, source rounds (`publish`) and sink round bookkeeping, recovery
requests, status and metrics. The HTTP listeners are in `agent.control_api`, the
Publisher's socket protocol in `agent.handoff_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from weightsync.agent.engine_adapter import adapter_for, build_adapter
from weightsync.agent.engine_watch import EngineWatch
from weightsync.agent.generations import Generation, Generations, PlanRejectedError
from weightsync.agent.holder import Holder
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.packing import SourcePacker
from weightsync.agent.recovery import Recovery, RecoveryFailed
from weightsync.agent.rounds import RoundFailed, RoundHeader, RoundOutcome, SlotPool, SwitchNotice
from weightsync.agent.settings import AgentSettings
from weightsync.agent.sink import SinkLoop
from weightsync.agent.source import FillChannel, SourceRound
from weightsync.api.control import (
    AgentStatus,
    GenerationState,
    LocalEngine,
    MembershipPlan,
    PlanAccepted,
    RecoverRequest,
    RecoveryStatus,
    Role,
    RoundReport,
)
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.buffers import SlotError, TensorSources, open_sources
from weightsync.transfer.handoff import Attached, Publish, RoundResult
from weightsync.transfer.layout import BucketLayout, TensorMeta, plan_layout
from weightsync.transfer.p2p import Endpoints

log = logging.getLogger(__name__)


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.device = torch.device(settings.device)
        self.metrics = AgentMetrics(settings.role.value)
        self.generations = Generations(self.device, self.metrics)
        self.pool = SlotPool(self.device, str(settings.shm_dir))
        self.adapter: EngineAdapter | None = build_adapter(settings)
        self.layout: BucketLayout | None = None
        self.version: int | None = None
        self.lineage: str | None = None  # of `version`
        self.last_round: RoundReport | None = None
        self.watch = (
            EngineWatch(self.adapter, loaded_by_peer=settings.engine_loaded_by_peer)
            if self.adapter is not None
            else None
        )
        self.round_in_progress = False
        self._round_lock = asyncio.Lock()
        self._local_epoch = -1  # the slot epoch the local (Colocated) engine attached
        # A Colocated plan's engine (in another pod on this GPU) and its adapter.
        self._planned_engine: tuple[LocalEngine, EngineAdapter] | None = None
        self._publisher_epoch = -1  # the slot epoch the Publisher was last given
        self._packer: SourcePacker | None = None  # the Publisher's tensors, when shared
        self._tasks: list[asyncio.Task[None]] = []
        self.endpoints = Endpoints(settings.p2p_address, settings.p2p_devices)
        self.holder = Holder(
            self.device,
            self.endpoints,
            settings.p2p_protocol,
            self.metrics,
            enabled=settings.holds_by_default,
        )
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
                on_recovered=self._recovered,
            )

    @property
    def fill_timeout(self) -> float:
        plan = self.generations.newest_plan()
        return plan.transfer.timeout_seconds if plan else 60.0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.watch is not None:
            self._tasks.append(
                asyncio.create_task(self._supervise(self.watch.run_forever), name="engine-watch")
            )
        if self.settings.role == Role.SINK and self.adapter is not None:
            loop = SinkLoop(
                self.generations,
                self.pool,
                self.adapter,
                engine_timeout_seconds=self.settings.engine_timeout_seconds,
                holder=self.holder,
                before_round=self._yield_recovery,
                on_round_start=self._sink_round_started,
                on_round_end=self._round_finished,
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
        if self._planned_engine is not None:
            await self._planned_engine[1].close()
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
        self.holder.set_enabled(self.settings.holds_by_default or plan.holder)
        return PlanAccepted(
            generation=generation.number, rank=plan.rank, world_size=plan.world_size
        )

    async def status(self) -> AgentStatus:
        """Answered from what the agent knows: the engine's last polled health, never a
        call to a possibly frozen engine."""
        engine = self.watch.status() if self.watch is not None else None
        active = self.generations.active() or self.generations.newest_usable()
        return AgentStatus(
            pod=self.settings.pod_name,
            role=self.settings.role,
            generation=active.number if active else None,
            warm=active is not None and active.usable,
            version=self.version,
            lineage=self.lineage,
            round_in_progress=self.round_in_progress,
            generations=self.generations.statuses(),
            engine=engine,
            last_round=self.last_round,
            recovery=self.recovery.status() if self.recovery is not None else None,
            holding=self.holder.held_version,
            holding_lineage=self.holder.held_lineage,
        )

    # ---------------------------------------------------------------- recovery
    def _pipeline_depth(self) -> int:
        plan = self.generations.newest_plan()
        return plan.transfer.pipeline_depth if plan else 2

    def start_recovery(self, request: RecoverRequest) -> RecoveryStatus:
        """Start pulling from holders; refuse while a round uses the slots and the engine.

        A member of a warm generation recovers too (its engine restarted in place): a
        round that starts meanwhile stops the recovery and brings the engine current.
        """
        if self.recovery is None:
            raise RecoveryFailed("not_a_sink", "only a sink agent with an engine recovers")
        if self.round_in_progress:
            raise RecoveryFailed("busy", "a round is in progress")
        if self.watch is not None and self.watch.vouched() is not None:
            served = self.watch.vouched()
            if (
                served is not None
                and served.version >= request.version
                and (not request.lineage or served.lineage == request.lineage)
            ):
                raise RecoveryFailed(
                    "not_behind", f"the engine serves version {served.version} already"
                )
        return self.recovery.start(request)

    async def _yield_recovery(self) -> None:
        if self.recovery is not None:
            await self.recovery.yield_to_round()

    def _recovered(self, version: int, lineage: str) -> None:
        self.version, self.lineage = version, lineage
        if self.watch is not None:
            self.watch.committed(lineage, version)

    # ---------------------------------------------------------------- rounds
    def _sink_round_started(self, header: RoundHeader, generation: Generation) -> None:
        self.round_in_progress = True
        if generation.state == GenerationState.WARM:
            generation.state = GenerationState.ACTIVE
        self.metrics.generation.set(generation.number)

    def _round_finished(self, outcome: RoundOutcome, committed: bool) -> None:
        self.round_in_progress = False
        if outcome.ok:  # every rank committed: the staged copy is the group's version
            self.holder.commit(outcome.version, outcome.lineage)
        else:
            self.holder.abandon()
        if committed or outcome.ok:
            self.version, self.lineage = outcome.version, outcome.lineage
        if committed and self.watch is not None:  # this engine process serves it now
            self.watch.committed(outcome.lineage, outcome.version)
        if outcome.ok:
            self.metrics.round_succeeded(outcome.duration_seconds, outcome.nbytes, outcome.version)
        else:
            self.metrics.round_failed(outcome.duration_seconds, outcome.reason, outcome.stage)
        duration = max(outcome.duration_seconds, 1e-9)
        self.last_round = RoundReport(
            version=outcome.version,
            generation=outcome.generation,
            ok=outcome.ok,
            duration_millis=round(outcome.duration_seconds * 1000),
            bytes=outcome.nbytes,
            bandwidth_bytes_per_second=int(outcome.nbytes / duration) if outcome.ok else 0,
            reason=outcome.reason,
            message=outcome.message,
            finished_at_unix_millis=int(outcome.finished_at * 1000),
            lineage=outcome.lineage,
            member=outcome.member,
            stage=outcome.stage,
        )

    async def attach_publisher(
        self, metas: list[TensorMeta], sources: TensorSources | None = None
    ) -> Attached:
        plan = self.generations.newest_plan()
        if plan is None:
            raise RoundFailed("no_plan", "the agent has no membership plan yet")
        async with self._round_lock:
            layout = plan_layout(metas, plan.transfer.bucket_size_bytes)
            slots = self.pool.ensure(layout, plan.transfer.pipeline_depth)
            self.layout = layout
            self._publisher_epoch = self.pool.epoch
            self._packer = await self._map_sources(layout, sources)
        log.info(
            "layout %s: %d tensors, %d buckets, %d bytes, packed by the %s",
            layout.layout_hash[:12],
            len(metas),
            len(layout.buckets),
            layout.total_bytes,
            "agent" if self._packer is not None else "Publisher",
        )
        return Attached(
            layout_hash=layout.layout_hash,
            bucket_size_bytes=layout.bucket_size_bytes,
            alignment=layout.alignment,
            slots=slots.handles,
            agent_packs=self._packer is not None,
        )

    async def _map_sources(
        self, layout: BucketLayout, sources: TensorSources | None
    ) -> SourcePacker | None:
        """The Publisher's tensors mapped here, if shared and on this agent's GPU."""
        if sources is None or self.device.type != "cuda":
            return None
        names = [(m.name, m.shape, m.dtype) for m in layout.tensors]
        try:
            tensors = await asyncio.to_thread(open_sources, sources, names)
        except (SlotError, RuntimeError, SystemError) as exc:  # torch's IPC open: SystemError
            log.warning("cannot map the Publisher's tensors, it packs them itself: %s", exc)
            return None
        if any(t.device != self.device for t in tensors):
            log.warning("the Publisher's tensors are not on %s: it packs them itself", self.device)
            return None
        return SourcePacker(layout, tensors)

    async def _select_generation(self, deadline: float) -> Generation:
        """The newest warm generation; older ones are told to switch, then retired.

        With none warm, waits until `deadline` for one: a plan being pre-warmed, or the
        generation the operator plans after a failed round broke the last one.
        """
        newest = self.generations.newest_usable()
        while newest is None and (left := deadline - time.monotonic()) > 0:
            async with self.generations.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.generations.changed.wait(), left)
            newest = self.generations.newest_usable()
        if newest is None:
            raise RoundFailed("no_group", "no warm group generation; waiting for a plan")
        for old in self.generations.all():
            if old.number < newest.number and old.state != GenerationState.RETIRED:
                await self._switch_away(old, newest.number)
        if newest.state != GenerationState.ACTIVE:
            newest.state = GenerationState.ACTIVE
            self.metrics.generation.set(newest.number)
        return newest

    async def _switch_away(self, old: Generation, target: int) -> None:
        """Ring `old`'s doorbell with a switch notice (its sinks follow), then retire it."""
        group = old.group
        if group is not None:
            key = f"doorbell/{old.next_seq}"
            notice = SwitchNotice(generation=target).model_dump_json()
            old.next_seq += 1
            try:
                await asyncio.wait_for(group.run(lambda: group.ctl.set(key, notice)), 5.0)
            except (TimeoutError, RuntimeError) as exc:
                log.warning("could not tell generation %d to switch: %s", old.number, exc)
        old.retire()

    async def publish(self, request: Publish, channel: FillChannel) -> RoundResult:
        async with self._round_lock:
            started = time.monotonic()
            try:
                self._check_version(request)
                outcome = await self._run_source_round(request, channel, started)
            except RoundFailed as exc:
                outcome = RoundOutcome.failed(
                    request.version,
                    None,
                    started,
                    exc.reason,
                    str(exc),
                    lineage=request.lineage,
                    member=f"{self.settings.pod_name} (rank 0, source)",
                    stage=exc.stage.value,
                )
            except Exception as exc:  # the Publisher gets a result whatever went wrong here
                log.exception("round for version %d failed unexpectedly", request.version)
                outcome = RoundOutcome.failed(
                    request.version,
                    None,
                    started,
                    "internal_error",
                    repr(exc),
                    lineage=request.lineage,
                )
            self._round_finished(outcome, committed=False)
        return RoundResult(
            version=outcome.version,
            ok=outcome.ok,
            duration_seconds=outcome.duration_seconds,
            bytes=outcome.nbytes,
            reason=outcome.reason,
            message=outcome.message,
            generation=outcome.generation,
            member=outcome.member,
            stage=outcome.stage,
        )

    def _check_version(self, request: Publish) -> None:
        """Versions rise within a lineage (a Publisher); a new lineage starts anywhere."""
        last = self.version
        if request.lineage == self.lineage and last is not None and request.version <= last:
            raise RoundFailed(
                "stale_version",
                f"version {request.version} is not above {last}, the last committed by this"
                " Publisher: versions must rise (a restarted trainer gets a new Publisher)",
            )

    async def _run_source_round(
        self, request: Publish, channel: FillChannel, started: float
    ) -> RoundOutcome:
        layout = self.layout
        if layout is None or request.layout_hash != layout.layout_hash:
            raise RoundFailed("layout_mismatch", "the tensor set changed: attach again")
        plan = self.generations.newest_plan()
        # publish() returns within the transfer timeout: waiting for a group counts too.
        deadline = started + (plan.transfer.timeout_seconds if plan else 60.0)
        generation = await self._select_generation(deadline)
        transfer = generation.plan.transfer
        if transfer.bucket_size_bytes != layout.bucket_size_bytes:
            raise RoundFailed("layout_mismatch", "the plan changed the bucket size: attach again")
        slots = self.pool.ensure(layout, transfer.pipeline_depth)
        if self.pool.epoch != self._publisher_epoch:
            raise RoundFailed("layout_mismatch", "the bucket slots changed: attach again")
        local = await self._local_engine(generation.plan.local_engine)
        if local is not None and self._local_epoch != self.pool.epoch:
            try:
                await asyncio.wait_for(
                    local.attach_buffers(slots.slots), self.settings.engine_timeout_seconds
                )
            except (EngineError, TimeoutError) as exc:
                raise RoundFailed("engine_attach_failed", f"attach: {exc!r}") from exc
            self._local_epoch = self.pool.epoch
        group = generation.group
        packer = self._packer if self._packer and self._packer.layout is layout else None
        if packer is not None and group is not None:
            channel = packer.channel(slots.slots, group.run)
        self.round_in_progress = True
        runner = SourceRound(
            generation,
            layout,
            slots,
            request.version,
            channel,
            lineage=request.lineage,
            local_engine=local,
            engine_timeout_seconds=self.settings.engine_timeout_seconds,
            holder=self.holder,
            hold_from=packer.by_name if packer is not None else None,
            deadline=deadline,
        )
        return await runner.run()

    async def _local_engine(self, planned: LocalEngine | None) -> EngineAdapter | None:
        """The engine a source round hands buckets to: the plan's (Colocated), else the
        agent's own, if any. A new planned engine (its pod was replaced) attaches anew."""
        if planned is None:
            return self.adapter
        if self._planned_engine is not None:
            known, adapter = self._planned_engine
            if known == planned:
                return adapter
            await adapter.close()
        log.info("colocated engine: %s of pod %s at %s", planned.engine, planned.pod, planned.url)
        adapter = adapter_for(planned.engine, planned.url, planned.options)
        self._planned_engine = (planned, adapter)
        self._local_epoch = -1
        return adapter
