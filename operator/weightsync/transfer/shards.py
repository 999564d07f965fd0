"""Sharded sources: who owns which bytes of every tensor, and how a bucket travels. Pure.

Every source rank reports the tensors it publishes with the *box* it holds of each: the
whole tensor, a block of it (a shard along one or more dimensions, uneven ones included),
or nothing. The model is every tensor any rank reports (a rank that does not list an
expert holds none of it). From every rank's report, `plan_shards` decides once:

* **Ownership.** Identical boxes on several ranks are replicas: the lowest rank owns
  them. Otherwise the boxes must tile the tensor exactly (pairwise disjoint, every
  element covered), or planning fails naming the tensor and the rule it breaks.
* **Buckets** are planned over whole tensors (`layout.plan_layout`), so engines see
  exactly what a single source would send them.
* **Segments.** A bucket travels as a few broadcasts, each from one owner:
  - a *direct* segment is a run of whole tensors of one owner that lie next to each
    other in the bucket: it is received straight into the bucket slot, at its place;
  - an owner's other pieces of the bucket (shards, and whole tensors in runs too small
    to be worth a broadcast of their own) travel in one *staged* segment, packed
    back to back, and receivers copy each piece into its box of the full tensor.
  With one source every bucket is one direct segment: the same single broadcast per
  bucket as an unsharded round.

Receivers need a staging buffer of `ShardPlan.staging_bytes` (zero when every segment is
direct). Offsets of pieces are aligned like the bucket layout's, so a direct segment's
bytes, padding included, are exactly the slot's bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import combinations

from weightsync.transfer.layout import (
    DEFAULT_ALIGNMENT,
    DTYPE_ITEMSIZE,
    BucketLayout,
    LayoutError,
    TensorMeta,
    align_up,
    plan_layout,
)

# A run of whole tensors smaller than this joins its owner's staged segment: a broadcast
# of its own would cost more in launch and vote latency than the copy it saves.
DIRECT_MIN_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Box:
    """A block of a tensor: `shape` elements starting at index `offset`, per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    def is_whole(self, shape: Sequence[int]) -> bool:
        return self.shape == tuple(shape) and not any(self.offset)

    def overlaps(self, other: Box) -> bool:
        return all(
            a < b + m and b < a + n
            for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape, strict=True)
        )

    def to_json(self) -> list[list[int]]:
        return [list(self.offset), list(self.shape)]


@dataclass(frozen=True)  # no slots: its JSON and digest are cached (tens of thousands of tensors)
class RankReport:
    """What one source rank holds: the tensors it publishes, each with its box or None."""

    rank: int
    tensors: tuple[tuple[TensorMeta, Box | None], ...]

    def to_json(self) -> str:
        return self.body

    @cached_property
    def body(self) -> str:
        return json.dumps(
            {
                "rank": self.rank,
                "tensors": [
                    [*meta.to_json(), box.to_json() if box else None] for meta, box in self.tensors
                ],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> RankReport:
        data = json.loads(raw)
        tensors = []
        for *meta, box in data["tensors"]:
            tensors.append(
                (TensorMeta.from_json(meta), Box(tuple(box[0]), tuple(box[1])) if box else None)
            )
        return cls(int(data["rank"]), tuple(tensors))

    @cached_property
    def digest(self) -> str:
        """What the round header carries for this report (the store key of its body)."""
        return hashlib.sha256(self.body.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Piece:
    """One owner's block of one tensor, as it travels in a segment."""

    name: str
    dtype: str
    box: Box
    offset: int  # bytes from the start of the segment's buffer (slot or staging)
    nbytes: int


@dataclass(frozen=True, slots=True)
class Segment:
    """One broadcast of a bucket, from `owner`, into the slot (direct) or staging."""

    owner: int
    direct: bool
    offset: int  # where the segment starts in its buffer
    nbytes: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """`plan_shards`'s result: the engine-facing layout plus how each bucket travels."""

    layout: BucketLayout
    owners: tuple[int, ...]  # source ranks that own at least one byte, ascending
    segments: tuple[tuple[Segment, ...], ...]  # per bucket, in broadcast order
    staging_bytes: int
    plan_hash: str

    def segments_of(self, rank: int, bucket: int) -> tuple[Segment, ...]:
        """What `rank` packs and broadcasts for `bucket`."""
        return tuple(s for s in self.segments[bucket] if s.owner == rank)


def _check_box(meta: TensorMeta, box: Box, rank: int) -> None:
    if len(box.offset) != len(meta.shape) or len(box.shape) != len(meta.shape):
        raise LayoutError(
            f"tensor {meta.name!r}: rank {rank}'s box {box.to_json()} does not have the "
            f"{len(meta.shape)} dimensions of shape {list(meta.shape)}"
        )
    for dim, (start, size, full) in enumerate(zip(box.offset, box.shape, meta.shape, strict=True)):
        if start < 0 or size < 0 or start + size > full:
            raise LayoutError(
                f"tensor {meta.name!r}: rank {rank}'s box {box.to_json()} leaves dimension "
                f"{dim} of shape {list(meta.shape)}"
            )


def _agreed_tensors(reports: Sequence[RankReport]) -> tuple[TensorMeta, ...]:
    """Every tensor any rank reported: the lowest rank's in its order, then each further
    rank's new ones in its order. Ranks that list a tensor agree on its shape and dtype."""
    if not reports:
        raise LayoutError("no source rank reported its tensors")
    seen: dict[str, tuple[int, TensorMeta]] = {}
    order: list[TensorMeta] = []
    for report in reports:
        names = set()
        for meta, _ in report.tensors:
            if meta.name in names:
                raise LayoutError(f"rank {report.rank} lists tensor {meta.name!r} twice")
            names.add(meta.name)
            known = seen.get(meta.name)
            if known is None:
                seen[meta.name] = (report.rank, meta)
                order.append(meta)
            elif known[1] != meta:
                raise LayoutError(
                    f"ranks {known[0]} and {report.rank} disagree on a tensor: {known[1]} vs "
                    f"{meta} (every rank lists a tensor with its global shape and dtype)"
                )
    return tuple(order)


def _owners_of(meta: TensorMeta, held: list[tuple[int, Box]]) -> list[tuple[int, Box]]:
    """Each distinct box once, owned by the lowest rank holding it; checked to tile."""
    distinct: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, Box]] = {}
    for rank, box in sorted(held, key=lambda item: item[0]):
        if box.numel == 0:
            continue
        distinct.setdefault((box.offset, box.shape), (rank, box))
    owned = sorted(distinct.values(), key=lambda item: (item[1].offset, item[0]))
    for (rank_a, a), (rank_b, b) in combinations(owned, 2):
        if a.overlaps(b):
            raise LayoutError(
                f"tensor {meta.name!r}: ranks {rank_a} and {rank_b} hold overlapping, "
                f"different boxes {a.to_json()} and {b.to_json()}"
            )
    numel = Box.whole(meta.shape).numel
    covered = sum(box.numel for _, box in owned)
    if covered == 0 and numel:
        raise LayoutError(f"tensor {meta.name!r}: no source rank holds any of it")
    if covered != numel:
        raise LayoutError(
            f"tensor {meta.name!r}: the ranks' boxes cover {covered} of {numel} elements"
        )
    return owned


def _piece_bytes(meta: TensorMeta, box: Box) -> int:
    return box.numel * DTYPE_ITEMSIZE[meta.dtype]


def _segments(
    layout: BucketLayout,
    metas: dict[str, TensorMeta],
    owners: dict[str, list[tuple[int, Box]]],
) -> tuple[tuple[tuple[Segment, ...], ...], int]:
    alignment = layout.alignment
    plan: list[tuple[Segment, ...]] = []
    staging = 0
    for bucket in layout.buckets:
        # Runs of consecutive whole tensors with one owner, in bucket order.
        runs: list[tuple[int, list[int]]] = []
        staged: dict[int, list[tuple[str, Box]]] = {}
        for index, item in enumerate(bucket.tensors):
            held = owners[item.name]
            whole = len(held) == 1 and held[0][1].is_whole(item.shape)
            if whole:
                owner = held[0][0]
                if runs and runs[-1][0] == owner and runs[-1][1][-1] == index - 1:
                    runs[-1][1].append(index)
                else:
                    runs.append((owner, [index]))
                continue
            for owner, box in held:
                staged.setdefault(owner, []).append((item.name, box))
        segments: list[Segment] = []
        for owner, indices in runs:
            first, last = bucket.tensors[indices[0]], bucket.tensors[indices[-1]]
            end = align_up(last.offset + last.nbytes, alignment)
            alone = len(runs) == 1 and not staged
            if end - first.offset < DIRECT_MIN_BYTES and not alone:
                for index in indices:
                    name = bucket.tensors[index].name
                    staged.setdefault(owner, []).append((name, Box.whole(metas[name].shape)))
                continue
            pieces = tuple(
                Piece(t.name, t.dtype, Box.whole(t.shape), t.offset, t.nbytes)
                for t in (bucket.tensors[i] for i in indices)
            )
            segments.append(Segment(owner, True, first.offset, end - first.offset, pieces))
        cursor = 0
        for owner in sorted(staged):
            start = cursor
            pieces_list = []
            for name, box in staged[owner]:
                nbytes = _piece_bytes(metas[name], box)
                pieces_list.append(Piece(name, metas[name].dtype, box, cursor, nbytes))
                cursor = align_up(cursor + nbytes, alignment)
            segments.append(Segment(owner, False, start, cursor - start, tuple(pieces_list)))
        staging = max(staging, cursor)
        segments.sort(key=lambda s: (s.owner, not s.direct, s.offset))
        plan.append(tuple(segments))
    return tuple(plan), staging


def single_source(layout: BucketLayout, rank: int = 0) -> ShardPlan:
    """The plan of a round with one source holding every tensor whole: each bucket is one
    direct broadcast of the whole slot (what `plan_shards` plans for it, without the work)."""
    segments = tuple((Segment(rank, True, 0, bucket.nbytes, ()),) for bucket in layout.buckets)
    return ShardPlan(layout, (rank,), segments, 0, layout.layout_hash)


def staging_bound(layout: BucketLayout, sources: int) -> int:
    """Staging bytes any plan of `layout` over `sources` ranks may need: a bucket's staged
    pieces tile its tensors, each piece padded to the alignment, at most one piece per
    tensor and rank. Slots are sized with it before the ranks' reports are known."""
    if sources <= 1:
        return 0
    return max(
        (
            sum(t.nbytes for t in bucket.tensors) + len(bucket.tensors) * sources * layout.alignment
            for bucket in layout.buckets
        ),
        default=0,
    )


def plan_shards(
    reports: Sequence[RankReport],
    bucket_size_bytes: int,
    alignment: int = DEFAULT_ALIGNMENT,
) -> ShardPlan:
    """Ownership, buckets and segments from every source rank's report (module doc)."""
    reports = sorted(reports, key=lambda r: r.rank)
    ranks = [r.rank for r in reports]
    if len(set(ranks)) != len(ranks):
        raise LayoutError(f"a source rank reported twice: {ranks}")
    metas = _agreed_tensors(reports)
    layout = plan_layout(metas, bucket_size_bytes, alignment)
    by_name = {m.name: m for m in metas}
    held: dict[str, list[tuple[int, Box]]] = {m.name: [] for m in metas}
    for report in reports:
        for meta, box in report.tensors:
            if box is not None:
                _check_box(meta, box, report.rank)
                held[meta.name].append((report.rank, box))
    owners = {meta.name: _owners_of(meta, held[meta.name]) for meta in metas}
    segments, staging = _segments(layout, by_name, owners)
    canonical = json.dumps(
        {
            "v": 1,
            "layout": layout.layout_hash,
            "owners": [
                [name, [[rank, *box.to_json()] for rank, box in owners[name]]] for name in by_name
            ],
        },
        separators=(",", ":"),
    )
    return ShardPlan(
        layout=layout,
        owners=tuple(sorted({rank for held in owners.values() for rank, _ in held})),
        segments=segments,
        staging_bytes=staging,
        plan_hash=hashlib.sha256(canonical.encode()).hexdigest(),
    )
