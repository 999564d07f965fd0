"""The sharded-source plan: ownership, segments, and bytes through pack -> place."""

from __future__ import annotations

import pytest
import torch

from weightsync.transfer.assembly import pack_segment, place_pieces
from weightsync.transfer.layout import LayoutError, TensorMeta
from weightsync.transfer.shards import (
    DIRECT_MIN_BYTES,
    Box,
    RankReport,
    Segment,
    ShardPlan,
    plan_shards,
    single_source,
    staging_bound,
)

MiB = 1 << 20


def dim_shards(shape: tuple[int, ...], dim: int, ranks: int) -> list[Box]:
    """torch.chunk's split of `shape` along `dim` (uneven last shards, empty ones too)."""
    size = shape[dim]
    step = -(-size // ranks)
    boxes = []
    for rank in range(ranks):
        start = min(rank * step, size)
        length = max(0, min(step, size - start))
        offset = [0] * len(shape)
        offset[dim] = start
        extent = list(shape)
        extent[dim] = length
        boxes.append(Box(tuple(offset), tuple(extent)))
    return boxes


def report(rank: int, items: list[tuple[TensorMeta, Box | None]]) -> RankReport:
    return RankReport(rank, tuple(items))


def local_piece(full: torch.Tensor, box: Box) -> torch.Tensor:
    view = full
    for dim, (start, size) in enumerate(zip(box.offset, box.shape, strict=True)):
        view = view.narrow(dim, start, size)
    return view.contiguous()


def simulate(plan: ShardPlan, full: dict[str, torch.Tensor], reports: list[RankReport]) -> None:
    """Every owner packs, every segment 'travels', a receiver places; slots match `full`."""
    held = {
        r.rank: {meta.name: local_piece(full[meta.name], box) for meta, box in r.tensors if box}
        for r in reports
    }
    layout = plan.layout
    for bucket, segments in zip(layout.buckets, plan.segments, strict=True):
        slot = torch.zeros(layout.capacity_bytes, dtype=torch.uint8)
        staging = torch.zeros(max(plan.staging_bytes, 1), dtype=torch.uint8)
        for segment in segments:
            # The owner packs into its own buffers; the broadcast copies those bytes.
            sent_slot = torch.zeros_like(slot)
            sent_staging = torch.zeros_like(staging)
            pack_segment(
                segment, held[segment.owner], sent_slot if segment.direct else sent_staging
            )
            span = slice(segment.offset, segment.offset + segment.nbytes)
            if segment.direct:
                slot[span] = sent_slot[span]
            else:
                staging[span] = sent_staging[span]
                place_pieces(bucket, segment, staging, slot)
        for item in bucket.tensors:
            got = slot[item.offset : item.offset + item.nbytes].view(full[item.name].dtype)
            assert torch.equal(got.view(item.shape), full[item.name]), item.name


def test_one_source_is_one_direct_segment_per_bucket() -> None:
    metas = [TensorMeta(f"w{i}", (256, 256), "float32") for i in range(8)]
    plan = plan_shards([report(0, [(m, Box.whole(m.shape)) for m in metas])], 1 * MiB)
    assert len(plan.layout.buckets) == 2
    for bucket, segments in zip(plan.layout.buckets, plan.segments, strict=True):
        assert len(segments) == 1
        (segment,) = segments
        assert segment.direct
        assert (segment.offset, segment.nbytes) == (0, bucket.nbytes)
    assert plan.staging_bytes == 0
    assert plan.owners == (0,)


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_dim_shards_even_and_uneven_assemble_bit_exact(ranks: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(ranks * 10 + dim)
    shapes = {"embed": (50, 24), "q": (24, 24), "norm": (24,), "odd": (7, 5)}
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    metas = [TensorMeta(n, s, "float32") for n, s in shapes.items()]
    reports = []
    for rank in range(ranks):
        items: list[tuple[TensorMeta, Box | None]] = []
        for meta in metas:
            if meta.name == "norm":  # replicated everywhere
                items.append((meta, Box.whole(meta.shape)))
            else:
                shard_dim = min(dim, len(meta.shape) - 1)
                items.append((meta, dim_shards(meta.shape, shard_dim, ranks)[rank]))
        reports.append(report(rank, items))
    plan = plan_shards(reports, 4096)
    simulate(plan, full, reports)
    for segments in plan.segments:
        owners = [s.owner for s in segments]
        assert owners == sorted(owners)
    # The replicated tensor is sent once, by the lowest rank.
    sent = [p for segs in plan.segments for s in segs for p in s.pieces if p.name == "norm"]
    assert len(sent) == 1


def test_tensor_parallel_grid_and_expert_ownership() -> None:
    gen = torch.Generator().manual_seed(7)
    # A 2x2 block grid (a 2-D mesh) and whole experts owned by one rank each.
    full = {"grid": torch.randn(6, 10, generator=gen)}
    full |= {f"expert.{e}": torch.randn(1024, 1024, generator=gen) for e in range(4)}
    metas = [TensorMeta(n, tuple(t.shape), "float32") for n, t in full.items()]
    blocks = {
        0: Box((0, 0), (3, 5)),
        1: Box((0, 5), (3, 5)),
        2: Box((3, 0), (3, 5)),
        3: Box((3, 5), (3, 5)),
    }
    reports = []
    for rank in range(4):
        items: list[tuple[TensorMeta, Box | None]] = [(metas[0], blocks[rank])]
        for e, meta in enumerate(metas[1:]):
            items.append((meta, Box.whole(meta.shape) if e == rank else None))
        reports.append(report(rank, items))
    plan = plan_shards(reports, 8 * MiB)
    simulate(plan, full, reports)
    direct = [s for segs in plan.segments for s in segs if s.direct]
    assert {p.name for s in direct for p in s.pieces} == {f"expert.{e}" for e in range(4)}
    assert all(s.nbytes >= DIRECT_MIN_BYTES for s in direct)


def test_small_runs_of_whole_tensors_join_the_staged_segment() -> None:
    norm = TensorMeta("norm", (16,), "float32")
    weight = TensorMeta("w", (8, 16), "float32")
    reports = [
        report(0, [(norm, Box.whole(norm.shape)), (weight, Box((0, 0), (4, 16)))]),
        report(1, [(norm, Box.whole(norm.shape)), (weight, Box((4, 0), (4, 16)))]),
    ]
    plan = plan_shards(reports, 1 * MiB)
    (segments,) = plan.segments
    assert [(s.owner, s.direct) for s in segments] == [(0, False), (1, False)]
    assert {p.name for p in segments[0].pieces} == {"norm", "w"}
    full = {"norm": torch.arange(16.0), "w": torch.arange(128.0).view(8, 16)}
    simulate(plan, full, reports)


def test_plan_hash_tells_ownerships_apart() -> None:
    meta = TensorMeta("w", (4, 4), "float32")
    halves = dim_shards(meta.shape, 0, 2)
    a = plan_shards([report(0, [(meta, halves[0])]), report(1, [(meta, halves[1])])], MiB)
    b = plan_shards([report(0, [(meta, halves[1])]), report(1, [(meta, halves[0])])], MiB)
    same = plan_shards([report(1, [(meta, halves[1])]), report(0, [(meta, halves[0])])], MiB)
    assert a.plan_hash != b.plan_hash
    assert a.plan_hash == same.plan_hash
    assert a.layout.layout_hash == b.layout.layout_hash  # engines see the same buckets


@pytest.mark.parametrize(
    ("boxes", "message"),
    [
        ([Box((0, 0), (3, 4)), Box((2, 0), (2, 4))], "overlapping"),
        ([Box((0, 0), (2, 4)), Box((3, 0), (1, 4))], "cover 12 of 16"),
        ([Box((0, 0), (4, 4)), Box((0, 0), (5, 4))], "leaves dimension 0"),
        ([Box((0,), (4,)), None], "does not have the 2 dimensions"),
    ],
)
def test_boxes_that_do_not_tile_name_the_tensor_and_rule(
    boxes: list[Box | None], message: str
) -> None:
    meta = TensorMeta("layers.0.w", (4, 4), "float32")
    reports = [report(rank, [(meta, box)]) for rank, box in enumerate(boxes)]
    with pytest.raises(LayoutError, match=message) as info:
        plan_shards(reports, MiB)
    assert "layers.0.w" in str(info.value)


def test_ranks_must_agree_on_the_tensor_set() -> None:
    a = TensorMeta("w", (4, 4), "float32")
    b = TensorMeta("w", (4, 4), "bfloat16")
    with pytest.raises(LayoutError, match="ranks 0 and 1 disagree"):
        plan_shards([report(0, [(a, Box.whole(a.shape))]), report(1, [(b, None)])], MiB)
    with pytest.raises(LayoutError, match="rank 1 lists tensor 'w' twice"):
        plan_shards([report(1, [(a, None), (a, None)])], MiB)
    with pytest.raises(LayoutError, match="reported twice"):
        plan_shards([report(0, [(a, Box.whole(a.shape))])] * 2, MiB)


def test_a_rank_that_does_not_list_a_tensor_holds_none_of_it() -> None:
    """Expert parallel as trainers write it: each rank publishes the experts it owns."""
    experts = [TensorMeta(f"expert.{e}", (64, 64), "float32") for e in range(4)]
    shared = TensorMeta("norm", (64,), "float32")
    reports = [
        report(r, [(shared, Box.whole(shared.shape)), (experts[r], Box.whole((64, 64)))])
        for r in range(4)
    ]
    plan = plan_shards(reports, MiB)
    assert [t.name for t in plan.layout.tensors] == ["norm", *(m.name for m in experts)]
    owners = {p.name: s.owner for segs in plan.segments for s in segs for p in s.pieces}
    assert owners == {"norm": 0, **{f"expert.{e}": e for e in range(4)}}
    full = {m.name: torch.randn(m.shape) for m in [shared, *experts]}
    simulate(plan, full, reports)
    with pytest.raises(LayoutError, match=r"'expert\.0': no source rank holds any of it"):
        plan_shards([report(0, [(experts[0], None)])], MiB)


def test_single_source_is_what_plan_shards_plans_for_one_source() -> None:
    metas = [TensorMeta(f"w{i}", (100 + i, 300), "bfloat16") for i in range(40)]
    planned = plan_shards([report(0, [(m, Box.whole(m.shape)) for m in metas])], 1 * MiB)
    assert single_source(planned.layout).segments == tuple(
        tuple(Segment(s.owner, s.direct, s.offset, s.nbytes, ()) for s in segs)
        for segs in planned.segments
    )


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_staging_bound_covers_every_plan(ranks: int) -> None:
    metas = [TensorMeta(f"w{i}", (7 + i, 33), "float32") for i in range(30)]
    for dim in (0, 1):
        reports = [
            report(r, [(m, dim_shards(m.shape, dim, ranks)[r]) for m in metas])
            for r in range(ranks)
        ]
        plan = plan_shards(reports, 64 << 10)
        assert 0 < plan.staging_bytes <= staging_bound(plan.layout, ranks)
    assert staging_bound(plan.layout, 1) == 0


def test_a_report_travels_as_json() -> None:
    a = TensorMeta("w", (4, 6), "bfloat16")
    b = TensorMeta("v", (3,), "float32")
    sent = report(2, [(a, Box((2, 0), (2, 6))), (b, None)])
    assert RankReport.from_json(sent.to_json()) == sent
    assert RankReport.from_json(sent.to_json()).digest == sent.digest
    assert report(2, [(a, Box((0, 0), (2, 6))), (b, None)]).digest != sent.digest
