"""The round's pipeline on one rank: the engine lane, the phase trace, and a Colocated
source round whose engine loads bucket k while the Publisher fills bucket k+1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import pytest
import torch

from tests.integration.stack import free_port
from tests.support.plans import local_plan
from weightsync.agent.engine_lane import EngineLane
from weightsync.agent.generations import Generation
from weightsync.agent.group import GroupSpec, form_group
from weightsync.agent.rounds import naming_peers
from weightsync.agent.source import SourceRound
from weightsync.agent.trace import PhaseTrace
from weightsync.api.control import (
    Backend,
    GenerationState,
    PlanMember,
    TransferOptions,
)
from weightsync.api.engines import EngineOptions
from weightsync.api.v1alpha1 import Role, SyncMode
from weightsync.engines.base import EngineAdapter, EngineError, EngineHealth
from weightsync.transfer.buffers import BucketSlots
from weightsync.transfer.layout import BucketLayout, TensorMeta, TensorSlice, plan_layout


def test_the_lane_runs_calls_in_order_and_keeps_the_first_failure() -> None:
    events: list[str] = []

    async def call(name: str, *, fail: bool = False, hang: bool = False) -> None:
        events.append(f"start {name}")
        await asyncio.sleep(0)
        if hang:
            await asyncio.Event().wait()
        if fail:
            raise EngineError("rejected", f"{name} refused")
        events.append(f"end {name}")

    async def scenario() -> None:
        trace = PhaseTrace(torch.device("cpu"))
        lane = EngineLane(timeout_seconds=0.5, trace=trace, deadline=time.monotonic() + 60)
        first = lane.submit("a", "engine_load", lambda: call("a"))
        lane.submit("b", "engine_load", lambda: call("b", fail=True))
        last = lane.submit("c", "engine_load", lambda: call("c"))
        assert events == []  # submit never waits for the engine
        await lane.wait(first)
        await lane.drain()
        assert last.done()
        assert events == ["start a", "end a", "start b"]
        assert lane.error is not None
        assert lane.error.reason == "engine_rejected"
        spans = trace.summary()["spans"]
        assert isinstance(spans, dict)
        assert spans["engine_load"][0] == 2  # the skipped call is not counted

        stuck = EngineLane(timeout_seconds=0.05, trace=trace, deadline=time.monotonic() + 60)
        await stuck.submit("d", "engine_load", lambda: call("d", hang=True))
        assert stuck.error is not None
        assert stuck.error.reason == "engine_timeout"

        cancelled = EngineLane(timeout_seconds=30, trace=trace, deadline=time.monotonic() + 60)
        pending = [cancelled.submit(n, "engine_load", lambda n=n: call(n, hang=True)) for n in "ef"]
        await asyncio.sleep(0)
        await cancelled.cancel()
        assert all(task.cancelled() for task in pending)
        assert cancelled.error is None

    asyncio.run(scenario())


def test_the_trace_summarises_spans_and_marks() -> None:
    trace = PhaseTrace(torch.device("cpu"))
    for _ in range(3):
        trace.add("fill", trace.now())
    trace.mark("streamed")
    summary = trace.summary(version=4)
    assert summary["version"] == 4
    spans = summary["spans"]
    assert isinstance(spans, dict)
    count, total, longest = spans["fill"]
    assert count == 3
    assert 0 <= longest <= total
    assert "streamed" in summary["marks"]  # type: ignore[operator]
    assert "gpu_ms" not in summary  # CPU ranks have no device events


class RecordingFill:
    """The Publisher's side: writes bucket k's marker byte into its slot."""

    def __init__(self, slots: BucketSlots, events: list[tuple[str, int]]) -> None:
        self.slots = slots
        self.events = events
        self.requested: dict[int, asyncio.Event] = {}

    def requested_event(self, bucket: int) -> asyncio.Event:
        return self.requested.setdefault(bucket, asyncio.Event())

    async def fill(self, bucket: int, slot: int) -> None:
        self.events.append(("fill", bucket))
        self.requested_event(bucket).set()
        await asyncio.sleep(0)
        self.slots.slots[slot].fill_(bucket + 1)


class SlowEngine(EngineAdapter):
    """Holds bucket k until the Publisher was asked for bucket k+1, then checks its slot.

    A source that waits for the engine before asking for the next fill never completes
    a round with it (each load times out); one that refills a slot the engine still
    reads makes the slot check fail.
    """

    def __init__(
        self,
        layout: BucketLayout,
        slots: BucketSlots,
        fill: RecordingFill,
        events: list[tuple[str, int]],
    ) -> None:
        self.index = {bucket.tensors: bucket.index for bucket in layout.buckets}
        self.last = len(layout.buckets) - 1
        self.slots = slots
        self.fill = fill
        self.events = events
        self.committed: int | None = None

    @classmethod
    def for_engine(cls, base_url: str, options: EngineOptions | None = None) -> Self:
        raise AssertionError("built by the test, never from a URL")

    async def attach_buffers(self, slots: Sequence[torch.Tensor], copies: int = 1) -> None:
        return None

    async def begin_update(self, version: int) -> None:
        self.events.append(("begin", version))

    async def load_bucket(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        bucket = self.index[tuple(tensors)]
        self.events.append(("load", bucket))
        if bucket < self.last:
            await self.fill.requested_event(bucket + 1).wait()
        for _ in range(3):
            await asyncio.sleep(0)
        if not bool((self.slots.slots[slot] == bucket + 1).all()):
            raise EngineError("corrupt", f"slot {slot} no longer holds bucket {bucket}")
        self.events.append(("loaded", bucket))

    async def finish_update(self, version: int) -> None:
        self.committed = version

    async def abort_update(self, version: int, reason: str) -> None:
        self.events.append(("abort", version))

    async def health(self) -> EngineHealth:
        return EngineHealth(healthy=True, version=self.committed)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_colocated_fill_overlaps_the_engine_and_never_refills_a_slot_in_use(
    tmp_path: Path, depth: int
) -> None:
    metas = [TensorMeta(f"w{i}", (1024,), "float32") for i in range(7)]
    layout = plan_layout(metas, 4096)
    slots = BucketSlots(depth, layout.capacity_bytes, torch.device("cpu"), str(tmp_path))
    events: list[tuple[str, int]] = []
    fill = RecordingFill(slots, events)
    engine = SlowEngine(layout, slots, fill, events)
    port = free_port()
    plan = local_plan(
        ["source-0"],
        0,
        generation=1,
        port=port,
        backend=Backend.GLOO,
        transfer=TransferOptions(pipeline_depth=depth, timeout_seconds=10.0),
        sync_name="pipeline",
        mode=SyncMode.COLOCATED,
        prewarm_timeout_seconds=10.0,
    )
    spec = GroupSpec(
        sync_name="pipeline",
        generation=1,
        rank=0,
        world_size=1,
        backend=Backend.GLOO,
        rendezvous_host="127.0.0.1",
        rendezvous_port=port,
        bind_host="127.0.0.1",
        device=torch.device("cpu"),
        collective_timeout_seconds=10.0,
        prewarm_timeout_seconds=10.0,
    )

    async def scenario() -> bool:
        group = await form_group(spec)
        generation = Generation(plan, state=GenerationState.WARM, group=group)
        try:
            outcome = await SourceRound(
                generation,
                layout,
                slots,
                3,
                fill,
                lineage="L1",
                local_engine=engine,
                engine_timeout_seconds=1.0 if depth == 1 else 10.0,
            ).run()
        finally:
            group.close()
        return outcome.ok

    try:
        ok = asyncio.run(scenario())
    finally:
        slots.close()
    buckets = len(layout.buckets)
    if depth == 1:  # one slot: the engine must finish a bucket before the next fill
        assert not ok
        assert ("abort", 3) in events
        return
    assert ok, events
    assert engine.committed == 3
    assert [b for kind, b in events if kind == "loaded"] == list(range(buckets))
    for bucket in range(buckets - depth):
        assert events.index(("loaded", bucket)) < events.index(("fill", bucket + depth))
    # Fill k+1 was asked for while the engine held bucket k.
    for bucket in range(buckets - 1):
        assert events.index(("fill", bucket + 1)) < events.index(("loaded", bucket))


def test_a_transport_error_names_the_member_behind_the_address_it_mentions() -> None:
    members = [
        PlanMember(rank=0, pod="trainer-0", host="10.0.0.1", role=Role.SOURCE),
        PlanMember(rank=1, pod="engine-a", host="10.0.0.2", role=Role.SINK),
        PlanMember(rank=2, pod="engine-b", host="10.0.0.20", role=Role.SINK),
    ]
    gloo = "collective failed: [pair.cc:547] Connection closed by peer [10.0.0.2]:65426"
    assert naming_peers(gloo, members, me=0) == f"{gloo}; peer: engine-a (rank 1)"
    # `[10.0.0.2]` is not `[10.0.0.20]`, and a rank never names itself.
    assert naming_peers(gloo, members, me=1) == gloo
    assert naming_peers("NCCL watchdog timeout", members, me=0) == "NCCL watchdog timeout"
