"""The reference engine's update channel, and the adapter choosing it over HTTP."""

from __future__ import annotations

import asyncio
import base64
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestServer

from weightsync.engines import reference_channel
from weightsync.engines.reference import ReferenceEngineAdapter
from weightsync.engines.reference_channel import (
    AbortRequest,
    BeginRequest,
    FinishRequest,
    Staged,
    UpdateChannelClient,
)
from weightsync.reference.arenas import BucketPlan
from weightsync.reference.channel import UpdateChannelServer
from weightsync.reference.engine import ReferenceEngine
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import PRESETS, build_model, state_dict_metas
from weightsync.reference.server import make_app
from weightsync.transfer.buffers import BucketSlots, copy_tensors, slot_views
from weightsync.transfer.layout import BucketLayout, plan_layout

CONFIG = PRESETS["tiny"]


@pytest.fixture
def slots(tmp_path: Path) -> Iterator[tuple[BucketLayout, BucketSlots]]:
    layout = plan_layout(state_dict_metas(CONFIG, "float32"), 8 << 10)
    slots = BucketSlots(2, layout.capacity_bytes, torch.device("cpu"), str(tmp_path))
    yield layout, slots
    slots.close()


@pytest.fixture
def address() -> str:
    return f"@weightsync-test-{uuid.uuid4().hex}"


@pytest.fixture
def shared_engine(address: str, tmp_path: Path) -> Iterator[ReferenceEngine]:
    """An engine whose arenas an agent can map (shared memory on CPU), its update channel
    served at `address`."""
    (tmp_path / "arenas").mkdir()
    engine = ReferenceEngine(build_model(CONFIG, seed=0), shm_dir=str(tmp_path / "arenas"))
    server = UpdateChannelServer(engine, address)
    server.start()
    yield engine
    server.close()
    engine.close()


def expected(seed: int) -> dict[str, str]:
    return {n: tensor_digest(p) for n, p in build_model(CONFIG, seed=seed).named_parameters()}


def fill(layout: BucketLayout, slots: BucketSlots, seed: int, index: int) -> int:
    """Put bucket `index` of the weights from `seed` into its slot; return the slot."""
    source = dict(build_model(CONFIG, seed=seed).named_parameters())
    bucket = layout.buckets[index]
    slot = index % len(slots.slots)
    views = slot_views(slots.slots[slot], bucket.tensors)
    copy_tensors(views, [source[t.name].detach() for t in bucket.tensors])
    return slot


async def send_round(
    adapter: ReferenceEngineAdapter,
    layout: BucketLayout,
    slots: BucketSlots,
    version: int,
    seed: int,
) -> None:
    """One update through the adapter: begin, every bucket of `layout`, finish."""
    await adapter.begin_update(version)
    for bucket in layout.buckets:
        slot = fill(layout, slots, seed, bucket.index)
        await adapter.load_bucket(slot, bucket.tensors)
    await adapter.finish_update(version)


def test_a_round_over_the_channel_names_each_bucket_once(
    slots: tuple[BucketLayout, BucketSlots], address: str
) -> None:
    layout, bucket_slots = slots
    engine = ReferenceEngine(build_model(CONFIG, seed=0))
    engine.attach(bucket_slots.handles)
    server = UpdateChannelServer(engine, address)
    server.start()

    async def rounds() -> None:
        client = UpdateChannelClient(address)
        for version, seed in [(1, 5), (2, 6)]:
            assert (await client.call(BeginRequest(version=version))).ok
            for bucket in layout.buckets:
                slot = fill(layout, bucket_slots, seed, bucket.index)
                reply = await client.load(slot, bucket.tensors)
                assert reply.ok, reply
            assert (await client.call(FinishRequest(version=version))).ok
            assert engine.digests() == (version, expected(seed))
        # A load outside an update is a reply, not a broken connection.
        refused = await client.load(0, layout.buckets[0].tensors)
        assert (refused.ok, refused.reason) == (False, "no_update")
        assert (await client.call(BeginRequest(version=3))).ok
        await client.close()

    try:
        asyncio.run(rounds())
    finally:
        server.close()


def test_a_cancelled_request_drops_the_connection_and_the_next_one_redescribes(
    slots: tuple[BucketLayout, BucketSlots], address: str
) -> None:
    layout, bucket_slots = slots
    engine = ReferenceEngine(build_model(CONFIG, seed=0))
    engine.attach(bucket_slots.handles)
    server = UpdateChannelServer(engine, address)
    server.start()
    release = threading.Event()
    load_plan = engine.load_plan

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        entered = asyncio.Event()

        def held_load(slot: int, plan: BucketPlan) -> None:
            loop.call_soon_threadsafe(entered.set)
            release.wait(10)
            load_plan(slot, plan)

        client = UpdateChannelClient(address)
        assert (await client.call(BeginRequest(version=1))).ok
        first = layout.buckets[0]
        slot = fill(layout, bucket_slots, 7, 0)
        assert (await client.load(slot, first.tensors)).ok
        engine.load_plan = held_load  # type: ignore[method-assign]
        pending = asyncio.create_task(client.load(slot, first.tensors))
        await entered.wait()
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        engine.load_plan = load_plan  # type: ignore[method-assign]
        release.set()
        # The cancelled load's late "ok" must not be taken for this request's answer.
        refused = await client.load(len(bucket_slots.slots), first.tensors)
        assert (refused.ok, refused.reason) == (False, "bad_slot")
        # A new connection: the engine learns every bucket's tensors again.
        for bucket in layout.buckets:
            slot = fill(layout, bucket_slots, 7, bucket.index)
            reply = await client.load(slot, bucket.tensors)
            assert reply.ok, reply
        assert (await client.call(FinishRequest(version=1))).ok
        await client.close()

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        server.close()
    assert engine.digests() == (1, expected(7))


@pytest.mark.parametrize(
    ("use_channel", "shared_arenas"), [(True, True), (True, False), (False, True)]
)
def test_the_adapter_copies_into_shared_arenas_or_lets_the_engine_copy(
    slots: tuple[BucketLayout, BucketSlots],
    address: str,
    tmp_path: Path,
    use_channel: bool,
    shared_arenas: bool,
) -> None:
    layout, bucket_slots = slots
    arenas = tmp_path / "arenas"
    arenas.mkdir()
    engine = ReferenceEngine(
        build_model(CONFIG, seed=0), shm_dir=str(arenas) if shared_arenas else None
    )
    server = UpdateChannelServer(engine, address)
    server.start()

    async def scenario() -> None:
        async with TestServer(make_app(engine, update_channel=address)) as http:
            adapter = ReferenceEngineAdapter(str(http.make_url("")), use_channel=use_channel)
            await adapter.attach_buffers(bucket_slots.slots)
            assert adapter.channel_address == (address if use_channel else None)
            assert adapter.copies_here == (use_channel and shared_arenas)
            for version, seed in [(1, 9), (2, 10), (3, 11)]:  # arenas alternate each round
                await send_round(adapter, layout, bucket_slots, version, seed)
                assert engine.digests() == (version, expected(seed))
            health = await adapter.health()
            assert (health.healthy, health.version) == (True, 3)
            assert health.incarnation == engine.incarnation == adapter.attached_to
            # A trainer restarted from an earlier step (a new lineage) goes back in numbers:
            # the engine takes it; ordering is the agent's business.
            await adapter.begin_update(2)
            await adapter.abort_update(2, "test")
            await adapter.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        engine.close()
    assert list(arenas.iterdir()) == [], "closing the engine unlinks its shared arenas"


def test_an_arena_handle_is_sent_once_per_connection_and_again_on_request(
    slots: tuple[BucketLayout, BucketSlots], address: str, shared_engine: ReferenceEngine
) -> None:
    layout, _ = slots
    bucket = layout.buckets[0]

    async def scenario() -> None:
        client = UpdateChannelClient(address)
        seen: list[Staged] = []
        for version in (1, 2, 3):
            assert (await client.call(BeginRequest(version=version))).ok
            for other in layout.buckets:
                staged = await client.stage(other.tensors)
                assert isinstance(staged, Staged)
                if other is bucket:
                    seen.append(staged)
            assert (await client.call(FinishRequest(version=version))).ok
        first, second, third = seen
        assert first.arena != second.arena  # staging and served arenas alternate
        assert third.arena == first.arena
        assert first.handle is not None
        assert second.handle is not None
        assert third.handle is None  # this connection has it already
        assert first.copies == second.copies == third.copies
        again = await client.handle(first.arena)
        assert again.handle == first.handle
        missing = await client.handle(10_000)
        assert (missing.ok, missing.reason) == (False, "bad_bucket")
        await client.close()

    asyncio.run(scenario())


def test_a_staging_begin_hands_out_every_arena_in_one_round_trip(
    slots: tuple[BucketLayout, BucketSlots], address: str, shared_engine: ReferenceEngine
) -> None:
    """A direct round's begin stages every bucket: the arenas and spans per-bucket
    staging hands out, each bucket's tensors described once per connection; a bucket the
    engine refuses refuses the whole begin, and an abort leaves the served version."""
    layout, _ = slots
    engine = shared_engine
    buckets = [b.tensors for b in layout.buckets]
    sent: list[bytes] = []

    async def scenario() -> None:
        client = UpdateChannelClient(address)
        rounds: list[list[Staged]] = []
        for version in (1, 2, 3):
            staged = await client.begin(version, buckets)
            assert isinstance(staged, list)
            assert len(staged) == len(buckets)
            assert engine.staged_buckets == len(buckets)
            rounds.append(staged)
            assert (await client.call(FinishRequest(version=version))).ok
        first, second, third = rounds
        assert [s.arena for s in first] == [s.arena for s in third]  # arenas alternate
        assert not {s.arena for s in first} & {s.arena for s in second}
        assert all(s.handle is not None for s in first + second)
        assert all(s.handle is None for s in third)  # mapped already on this connection
        assert [s.copies for s in first] == [s.copies for s in third]
        assert sent[0].count(b'"tensors":[[') == len(buckets)  # described once...
        assert all(b'"tensors":[[' not in body for body in sent[1:])  # ...numbers after
        wrong = [*buckets[:-1], (replace(buckets[-1][0], nbytes=buckets[-1][0].nbytes + 4),)]
        refused = await client.begin(4, wrong)
        assert not isinstance(refused, list)
        assert (refused.ok, refused.version) == (False, 3)
        assert (await client.call(AbortRequest(version=4))).ok
        assert engine.version == 3
        await client.close()

    real_frame = reference_channel.frame

    def recording_frame(body: bytes) -> bytes:
        if b'"op":"begin"' in body:
            sent.append(body)
        return real_frame(body)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference_channel, "frame", recording_frame)
        asyncio.run(scenario())


def test_a_finish_after_an_event_a_cpu_engine_cannot_wait_for_is_refused(
    slots: tuple[BucketLayout, BucketSlots], address: str, shared_engine: ReferenceEngine
) -> None:
    """`after` names a CUDA event: a CPU engine refuses it (unsupported), a handle that is
    not base64 is a bad request; either way the update stays open, and commits without."""
    layout, _ = slots
    engine = shared_engine

    async def scenario() -> None:
        client = UpdateChannelClient(address)
        assert isinstance(await client.begin(1, [b.tensors for b in layout.buckets]), list)
        handle = base64.b64encode(bytes(64)).decode()
        refused = await client.call(FinishRequest(version=1, after=handle))
        assert (refused.ok, refused.reason) == (False, "unsupported"), refused
        garbled = await client.call(FinishRequest(version=1, after="not base64!"))
        assert (garbled.ok, garbled.reason) == (False, "bad_request"), garbled
        assert engine.staged_buckets == len(layout.buckets)  # still open
        assert (await client.call(FinishRequest(version=1))).ok
        assert engine.version == 1
        await client.close()

    asyncio.run(scenario())


class _CopiesEventStandIn:
    """Stands in for an interprocess CUDA event on CPU (none exists there): an IPC handle
    the engine cannot open, and a synchronize that says it was waited for."""

    def __init__(self) -> None:
        self.waited = 0

    def ipc_handle(self) -> bytes:
        return bytes(64)

    def synchronize(self) -> None:
        self.waited += 1


def test_an_engine_that_cannot_open_the_copies_event_is_finished_after_a_local_wait(
    slots: tuple[BucketLayout, BucketSlots], address: str, shared_engine: ReferenceEngine
) -> None:
    """`finish_staged` to an engine that refuses `after` (this CPU engine, as a GPU engine
    that could not open the handle would): the adapter waits for the copies itself and
    finishes without it, and hands out no event from then on."""
    layout, bucket_slots = slots
    engine = shared_engine
    seed = 21
    source = dict(build_model(CONFIG, seed=seed).named_parameters())

    async def scenario() -> None:
        async with TestServer(make_app(engine, update_channel=address)) as http:
            adapter = ReferenceEngineAdapter(str(http.make_url("")))
            await adapter.attach_buffers(bucket_slots.slots)
            assert adapter.stages_directly
            buckets = [b.tensors for b in layout.buckets]
            views = await adapter.begin_staged(1, buckets)
            for tensors, bucket_views in zip(buckets, views, strict=True):
                copy_tensors(bucket_views, [source[t.name].detach() for t in tensors])
            copies = _CopiesEventStandIn()
            await adapter.finish_staged(1, copies)  # type: ignore[arg-type]
            assert copies.waited == 1
            assert engine.digests() == (1, expected(seed))
            assert adapter.copies_event(torch.device("cuda", 0)) is None
            await adapter.close()

    asyncio.run(scenario())


def test_arenas_the_agent_cannot_map_are_filled_by_the_engine(
    slots: tuple[BucketLayout, BucketSlots], address: str, tmp_path: Path
) -> None:
    layout, bucket_slots = slots
    arenas = tmp_path / "arenas"
    arenas.mkdir()
    engine = ReferenceEngine(build_model(CONFIG, seed=0), shm_dir=str(arenas))
    server = UpdateChannelServer(engine, address)
    server.start()

    def unlink_arenas() -> None:
        for name in arenas.iterdir():  # mapped ones stay valid; the others cannot be opened
            name.unlink()

    async def scenario() -> None:
        async with TestServer(make_app(engine, update_channel=address)) as http:
            adapter = ReferenceEngineAdapter(str(http.make_url("")))
            await adapter.attach_buffers(bucket_slots.slots)
            for version, seed in [(1, 13), (2, 14)]:
                assert adapter.copies_here
                await send_round(adapter, layout, bucket_slots, version, seed)
                assert engine.digests() == (version, expected(seed))
                unlink_arenas()  # round 2 stages into spares this process never mapped
            assert not adapter.copies_here
            await adapter.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        engine.close()


def test_a_new_layout_lets_go_of_the_old_layouts_arenas_before_staging(
    address: str, tmp_path: Path
) -> None:
    metas = state_dict_metas(CONFIG, "float32")
    small, large = plan_layout(metas, 8 << 10), plan_layout(metas, 16 << 10)
    bucket_slots = BucketSlots(2, large.capacity_bytes, torch.device("cpu"), str(tmp_path))
    arenas = tmp_path / "arenas"
    arenas.mkdir()
    engine = ReferenceEngine(build_model(CONFIG, seed=0), shm_dir=str(arenas))
    server = UpdateChannelServer(engine, address)
    server.start()

    async def scenario() -> None:
        async with TestServer(make_app(engine, update_channel=address)) as http:
            adapter = ReferenceEngineAdapter(str(http.make_url("")))
            await adapter.attach_buffers(bucket_slots.slots)
            assert adapter.copies_here
            # The layouts share their first buckets (a tensor that fills one alone).
            changed = next(
                i
                for i, (a, b) in enumerate(zip(small.buckets, large.buckets, strict=False))
                if a.tensors != b.tensors
            )
            assert 0 < changed < len(large.buckets)
            for version, seed in [(1, 21), (2, 22)]:
                await send_round(adapter, small, bucket_slots, version, seed)
            await adapter.begin_update(3)
            for bucket in large.buckets[: changed + 1]:
                slot = fill(large, bucket_slots, 23, bucket.index)
                await adapter.load_bucket(slot, bucket.tensors)
            # From the first new bucket on, the old layout's arenas (served and spare) are
            # no longer mapped here and its spares are gone: the engine holds the served
            # weights and this round's staging.
            assert adapter.mapped_arenas == changed + 1
            assert len(list(arenas.iterdir())) == len(small.buckets) + changed + 1
            for bucket in large.buckets[changed + 1 :]:
                slot = fill(large, bucket_slots, 23, bucket.index)
                await adapter.load_bucket(slot, bucket.tensors)
            await adapter.finish_update(3)
            assert engine.digests() == (3, expected(23))
            await send_round(adapter, large, bucket_slots, 4, 24)
            assert engine.digests() == (4, expected(24))
            # The layout's two arena sets alternate again, each mapped once.
            assert adapter.mapped_arenas == 2 * len(large.buckets)
            await adapter.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        engine.close()
        bucket_slots.close()
