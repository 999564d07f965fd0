"""The holder's staging and commit rules on CPU, with a real Mooncake endpoint (TCP)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

from weightsync.agent import holder as holder_module
from weightsync.agent.holder import Holder
from weightsync.agent.host_copies import copy_groups, within_slices
from weightsync.agent.metrics import AgentMetrics
from weightsync.api.control import Holding
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.transfer.held import held_checksum, held_offsets
from weightsync.transfer.layout import BucketLayout, TensorMeta, plan_layout
from weightsync.transfer.p2p import Endpoints

DEPTH = 2


def _held_bytes(holder: Holder) -> torch.Tensor | None:
    held = holder.held
    return None if held is None else held.buffer[: held.layout.total_bytes]


@pytest.fixture(scope="module")
def endpoints() -> Iterator[Endpoints]:
    shared = Endpoints(lambda: "127.0.0.31")
    yield shared
    shared.close()


def make_layout(sizes: list[int], bucket_size: int = 4096) -> BucketLayout:
    return plan_layout(
        [TensorMeta(f"t{i}", (n,), "float32") for i, n in enumerate(sizes)], bucket_size
    )


LAYOUT = make_layout([300, 700, 1000, 50, 900])  # several buckets, tensors padded to 256 B


def version_bytes(layout: BucketLayout, seed: int) -> list[torch.Tensor]:
    """One random byte string per bucket, as the round's slots would carry them."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, generator=generator)
        for b in layout.buckets
    ]


def new_holder(endpoints: Endpoints, *, enabled: bool = True) -> tuple[Holder, AgentMetrics]:
    metrics = AgentMetrics("sink", CollectorRegistry())
    holder = Holder(torch.device("cpu"), endpoints, RecoveryProtocol.TCP, metrics, enabled=enabled)
    return holder, metrics


async def stage_round(
    holder: Holder, layout: BucketLayout, version: int, buckets: list[torch.Tensor], upto: int
) -> None:
    """Stage buckets 0..upto-1 the way a round does: through `DEPTH` reused slots."""
    slots = [torch.zeros(layout.capacity_bytes, dtype=torch.uint8) for _ in range(DEPTH)]
    for bucket in layout.buckets[:upto]:
        slot = slots[bucket.index % DEPTH]
        slot[: bucket.nbytes].copy_(buckets[bucket.index])
        await holder.stage(version, layout, bucket, slot, DEPTH)


def held_gauge(metrics: AgentMetrics) -> float | None:
    return metrics.registry.get_sample_value("weightsync_held_version", {"role": "sink"})


def expect_held(
    holder: Holder, layout: BucketLayout, version: int, buckets: list[torch.Tensor]
) -> Holding:
    held = _held_bytes(holder)
    assert held is not None
    assert holder.held_version == version
    for bucket, offset in zip(layout.buckets, held_offsets(layout), strict=True):
        assert torch.equal(held[offset : offset + bucket.nbytes], buckets[bucket.index])
    holding = asyncio.run(holder.holding())
    assert holding is not None
    assert holding.version == version
    assert holding.layout_hash == layout.layout_hash
    assert BucketLayout.from_json(holding.layout) == layout
    assert holding.nbytes == layout.total_bytes
    assert holding.protocol == RecoveryProtocol.TCP
    assert holding.checksums == [
        held_checksum(b, bucket) for b, bucket in zip(buckets, layout.buckets, strict=True)
    ]
    assert holding.address == held.data_ptr()
    return holding


def test_offsets_put_the_buckets_back_to_back() -> None:
    assert len(LAYOUT.buckets) >= 3
    offsets = held_offsets(LAYOUT)
    assert offsets[0] == 0
    for previous, offset in zip(LAYOUT.buckets, offsets[1:], strict=False):
        assert offset == offsets[previous.index] + previous.nbytes
    assert offsets[-1] + LAYOUT.buckets[-1].nbytes == LAYOUT.total_bytes


def test_a_committed_round_becomes_the_held_version(endpoints: Endpoints) -> None:
    holder, metrics = new_holder(endpoints)
    buckets = version_bytes(LAYOUT, seed=1)
    assert asyncio.run(holder.holding()) is None
    asyncio.run(stage_round(holder, LAYOUT, 1, buckets, len(LAYOUT.buckets)))
    assert holder.held_version is None, "staged is not held before the commit"
    assert holder.commit(1, "L1")
    expect_held(holder, LAYOUT, 1, buckets)
    assert held_gauge(metrics) == 1
    assert holding_segment(holder) == endpoints.get(RecoveryProtocol.TCP).segment
    holder.close()


def holding_segment(holder: Holder) -> str:
    holding = asyncio.run(holder.holding())
    assert holding is not None
    return holding.segment


def test_a_failed_round_never_replaces_the_held_version(endpoints: Endpoints) -> None:
    holder, _ = new_holder(endpoints)
    first, second = version_bytes(LAYOUT, seed=1), version_bytes(LAYOUT, seed=2)
    asyncio.run(stage_round(holder, LAYOUT, 1, first, len(LAYOUT.buckets)))
    assert holder.commit(1, "L1")

    # Fully staged, then the round fails: abandoned.
    asyncio.run(stage_round(holder, LAYOUT, 2, second, len(LAYOUT.buckets)))
    holder.abandon()
    assert not holder.commit(2, "L1")
    expect_held(holder, LAYOUT, 1, first)

    # Partly staged and "committed" (a bucket never arrived here): refused.
    asyncio.run(stage_round(holder, LAYOUT, 2, second, len(LAYOUT.buckets) - 1))
    assert not holder.commit(2, "L1")
    expect_held(holder, LAYOUT, 1, first)

    # A commit for another version than the one staged does not take it.
    asyncio.run(stage_round(holder, LAYOUT, 3, second, len(LAYOUT.buckets)))
    assert not holder.commit(2, "L1")
    expect_held(holder, LAYOUT, 1, first)
    holder.close()


def test_commits_flip_between_two_registered_buffers(endpoints: Endpoints) -> None:
    holder, _ = new_holder(endpoints)
    addresses = []
    for version in (1, 2, 3, 4):
        buckets = version_bytes(LAYOUT, seed=version)
        asyncio.run(stage_round(holder, LAYOUT, version, buckets, len(LAYOUT.buckets)))
        assert holder.commit(version, "L1")
        addresses.append(expect_held(holder, LAYOUT, version, buckets).address)
    assert addresses[0] == addresses[2] != addresses[1] == addresses[3]
    holder.close()


def test_a_restaged_round_starts_over(endpoints: Endpoints) -> None:
    """The same version sent again (a retried round) restarts staging at bucket 0."""
    holder, _ = new_holder(endpoints)
    stale, fresh = version_bytes(LAYOUT, seed=5), version_bytes(LAYOUT, seed=6)
    asyncio.run(stage_round(holder, LAYOUT, 7, stale, len(LAYOUT.buckets) - 1))
    asyncio.run(stage_round(holder, LAYOUT, 7, fresh, 1))
    assert not holder.commit(7, "L1"), "only bucket 0 of the retry was staged"
    asyncio.run(stage_round(holder, LAYOUT, 7, fresh, len(LAYOUT.buckets)))
    assert holder.commit(7, "L1")
    expect_held(holder, LAYOUT, 7, fresh)
    holder.close()


def test_a_larger_layout_gets_a_larger_buffer_and_the_old_stays_held(
    endpoints: Endpoints,
) -> None:
    holder, _ = new_holder(endpoints)
    small = version_bytes(LAYOUT, seed=1)
    asyncio.run(stage_round(holder, LAYOUT, 1, small, len(LAYOUT.buckets)))
    assert holder.commit(1, "L1")
    large_layout = make_layout([2000, 3000, 1000, 4000, 10])
    assert large_layout.total_bytes > LAYOUT.total_bytes
    large = version_bytes(large_layout, seed=2)
    asyncio.run(stage_round(holder, large_layout, 2, large, len(large_layout.buckets) - 1))
    expect_held(holder, LAYOUT, 1, small)
    asyncio.run(stage_round(holder, large_layout, 2, large, len(large_layout.buckets)))
    assert holder.commit(2, "L1")
    expect_held(holder, large_layout, 2, large)
    holder.close()


def test_rounds_go_on_holding_with_free_buffers_of_several_sizes(endpoints: Endpoints) -> None:
    # A sharded rank prepares buffers for its own layout, then holds the round's larger
    # one: the free list mixes sizes, and taking a buffer from it must not compare them.
    large_layout = make_layout([2000, 3000, 1000, 4000, 10])

    async def scenario() -> None:
        holder, _ = new_holder(endpoints)
        holder.prepare(LAYOUT.total_bytes)  # two small buffers, as a rank's attach asks
        assert holder._allocating is not None
        await holder._allocating
        for version in (1, 2, 3):
            large = version_bytes(large_layout, seed=version)
            await stage_round(holder, large_layout, version, large, len(large_layout.buckets))
            assert holder.commit(version, "L1"), version
            held = _held_bytes(holder)
            assert held is not None
            assert torch.equal(held[: large[0].numel()], large[0])
        holder.close()

    asyncio.run(scenario())


def test_a_disabled_holder_stages_nothing_and_disabling_releases(endpoints: Endpoints) -> None:
    holder, metrics = new_holder(endpoints, enabled=False)
    buckets = version_bytes(LAYOUT, seed=1)
    asyncio.run(stage_round(holder, LAYOUT, 1, buckets, len(LAYOUT.buckets)))
    assert not holder.commit(1, "L1")
    assert asyncio.run(holder.holding()) is None

    holder.set_enabled(True)
    asyncio.run(stage_round(holder, LAYOUT, 2, buckets, len(LAYOUT.buckets)))
    assert holder.commit(2, "L1")
    assert held_gauge(metrics) == 2
    holder.set_enabled(False)
    assert holder.held_version is None
    assert asyncio.run(holder.holding()) is None
    assert held_gauge(metrics) == -1
    holder.close()


def test_a_round_staged_from_the_published_tensors_holds_their_bytes(
    endpoints: Endpoints,
) -> None:
    # The source agent that maps the Publisher's tensors copies them, not its slots.
    holder, _ = new_holder(endpoints)
    generator = torch.Generator().manual_seed(5)
    tensors = {m.name: torch.randn(m.shape, generator=generator) for m in LAYOUT.tensors}
    asyncio.run(holder.stage_tensors(3, LAYOUT, tensors))
    assert holder.commit(3, "L1")
    held = _held_bytes(holder)
    assert held is not None
    for bucket, offset in zip(LAYOUT.buckets, held_offsets(LAYOUT), strict=True):
        for t in bucket.tensors:
            start = offset + t.offset
            assert torch.equal(held[start : start + t.nbytes].view(torch.float32), tensors[t.name])
    holding = asyncio.run(holder.holding())
    assert holding is not None
    offsets = held_offsets(LAYOUT)
    regions = [held[o : o + b.nbytes] for b, o in zip(LAYOUT.buckets, offsets, strict=True)]
    assert holding.checksums == [
        held_checksum(r, b) for r, b in zip(regions, LAYOUT.buckets, strict=True)
    ]

    # A tensor missing from the set: the staging copy is dropped, version 3 stays held.
    del tensors["t2"]
    asyncio.run(holder.stage_tensors(4, LAYOUT, tensors))
    assert not holder.commit(4, "L1")
    assert holder.held_version == 3
    holder.close()


def test_copy_groups_cover_every_byte_once_in_bounded_groups() -> None:
    sources = [torch.arange(n, dtype=torch.float32) for n in (3, 5000, 7, 0, 2)]
    targets = [torch.zeros_like(t) for t in sources]
    groups = copy_groups(targets, sources, chunk=4096)
    assert all(sum(t.nbytes for t, _ in g) <= 4096 for g in groups)
    for group in groups:
        for target, source in group:
            target.copy_(source)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))
    assert len(groups) == 6  # elements: 3 | 1024 | 1024 | 1024 | 1024 | 904 + 7 + 0 + 2


def test_holders_that_fill_the_padding_differently_agree(endpoints: Endpoints) -> None:
    # A sink holder copies slots (the source's padding bytes, whatever they were); the
    # source copies the published tensors into its own buffer. Checksums skip padding.
    generator = torch.Generator().manual_seed(9)
    tensors = {m.name: torch.randn(m.shape, generator=generator) for m in LAYOUT.tensors}
    from_tensors, _ = new_holder(endpoints)
    asyncio.run(from_tensors.stage_tensors(1, LAYOUT, tensors))
    assert from_tensors.commit(1, "L1")
    buckets = []
    for bucket in LAYOUT.buckets:  # packed slots with random padding
        packed = torch.randint(0, 256, (bucket.nbytes,), dtype=torch.uint8, generator=generator)
        for t in bucket.tensors:
            packed[t.offset : t.offset + t.nbytes].view(torch.float32).copy_(tensors[t.name])
        buckets.append(packed)
    from_slots, _ = new_holder(endpoints)
    asyncio.run(stage_round(from_slots, LAYOUT, 1, buckets, len(LAYOUT.buckets)))
    assert from_slots.commit(1, "L1")
    one, other = asyncio.run(from_tensors.holding()), asyncio.run(from_slots.holding())
    assert one is not None
    assert other is not None
    assert one.checksums == other.checksums
    held = _held_bytes(from_slots)
    assert held is not None
    held[LAYOUT.buckets[0].tensors[1].offset] ^= 0xFF  # a tensor byte, not padding
    region = held[: LAYOUT.buckets[0].nbytes]
    assert held_checksum(region, LAYOUT.buckets[0]) != one.checksums[0]
    from_tensors.close()
    from_slots.close()


def test_large_buffers_are_allocated_off_the_round_and_held_from_then_on(
    endpoints: Endpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer over the inline limit (pinning 16 GB takes seconds) is allocated in the
    background: the round that finds none ready is not held, and does not wait."""
    monkeypatch.setattr(holder_module, "_INLINE_ALLOCATION_BYTES", 0)

    async def scenario() -> None:
        holder, _ = new_holder(endpoints)
        first, second = version_bytes(LAYOUT, seed=1), version_bytes(LAYOUT, seed=2)
        await stage_round(holder, LAYOUT, 1, first, len(LAYOUT.buckets))
        assert not holder.commit(1, "L1"), "no buffer was ready: version 1 is not held"
        assert holder.held_version is None
        assert holder._allocating is not None
        await holder._allocating
        assert len(holder._free) == 2  # the staging copy and the next one
        for version, buckets in ((2, second), (3, first)):
            await stage_round(holder, LAYOUT, version, buckets, len(LAYOUT.buckets))
            assert holder.commit(version, "L1")
            held = _held_bytes(holder)
            assert held is not None
            assert torch.equal(held[: buckets[0].numel()], buckets[0])
        assert holder.held_version == 3
        holder.close()

    asyncio.run(scenario())


def test_prepare_before_the_first_round_holds_it(
    endpoints: Endpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(holder_module, "_INLINE_ALLOCATION_BYTES", 0)

    async def scenario() -> None:
        holder, _ = new_holder(endpoints)
        holder.prepare(LAYOUT.total_bytes)  # as the source does at attach
        assert holder._allocating is not None
        await holder._allocating
        buckets = version_bytes(LAYOUT, seed=4)
        await stage_round(holder, LAYOUT, 1, buckets, len(LAYOUT.buckets))
        assert holder.commit(1, "L1")
        # Released while allocating: the late buffers are dropped, nothing is kept.
        holder.set_enabled(False)
        holder.set_enabled(True)
        holder.prepare(LAYOUT.total_bytes * 4)
        task = holder._allocating
        holder.release()
        assert task is not None
        await task
        assert holder._free == []
        holder.close()

    asyncio.run(scenario())


def test_copies_into_sliced_host_memory_never_cross_a_slice() -> None:
    """A GPU holder's buffer is page-locked in slices; the driver refuses a copy that
    crosses from one into the next, so copies are cut at the slices' edges."""
    host = torch.zeros(1000, dtype=torch.uint8)
    origin, slice_bytes = host.data_ptr(), 64
    sources = [torch.arange(n, dtype=torch.int16) for n in (40, 0, 3, 90)]
    offsets = [6, 86, 86, 100]  # int16 views at these byte offsets
    targets = [
        host[o : o + s.nbytes].view(torch.int16) for o, s in zip(offsets, sources, strict=True)
    ]
    pieces = within_slices(zip(targets, sources, strict=True), origin, slice_bytes)
    covered = []
    for target, source in pieces:
        start = target.data_ptr() - origin
        assert start // slice_bytes == (start + target.numel() - 1) // slice_bytes, start
        covered += range(start, start + target.numel())
        target.copy_(source)
    assert sorted(covered) == sorted(
        b for o, s in zip(offsets, sources, strict=True) for b in range(o, o + s.nbytes)
    )
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target, source)
