"""Bucket layout: which tensor goes where in which bucket. Pure; no torch needed.

A layout is computed once per tensor set (names, shapes, dtypes) and bucket size, and
sent once per group generation; a round then only names the layout by its hash.

Rules:
* Tensors keep the caller's order (a state dict's order is deterministic), packed
  greedily: a tensor starts a new bucket when it does not fit into the current one.
* Every tensor starts at a multiple of `alignment` bytes, so any dtype view of it is
  aligned and copies run on aligned addresses.
* Engines always receive whole tensors. A tensor larger than `bucket_size_bytes`
  therefore raises the bucket *capacity* to the largest tensor's aligned size
  (`BucketLayout.capacity_bytes`); the packing target stays `bucket_size_bytes`, so
  small tensors are still grouped as asked.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_ALIGNMENT = 256

# Element sizes by torch dtype name (without "torch."); planning must not need torch.
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Where one whole tensor lies inside a bucket buffer."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket
    nbytes: int


class LayoutError(ValueError):
    """The tensor set or the bucket settings cannot be laid out."""


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the layout needs to know about one tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        try:
            itemsize = DTYPE_ITEMSIZE[self.dtype]
        except KeyError:
            raise LayoutError(f"tensor {self.name!r}: unsupported dtype {self.dtype!r}") from None
        count = 1
        for dim in self.shape:
            if dim < 0:
                raise LayoutError(f"tensor {self.name!r}: negative dimension in {self.shape}")
            count *= dim
        return count * itemsize

    def to_json(self) -> list[object]:
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, raw: Sequence[object]) -> TensorMeta:
        name, shape, dtype = raw
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise LayoutError(f"malformed tensor metadata: {raw!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise LayoutError(f"malformed shape in tensor metadata: {raw!r}")
        return cls(name=name, shape=tuple(shape), dtype=dtype)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket: the whole tensors it carries and how many bytes it spans."""

    index: int
    tensors: tuple[TensorSlice, ...]
    nbytes: int  # aligned end of the last tensor: what a round moves for this bucket


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """The result of `plan_layout`; identified across processes by `layout_hash`."""

    tensors: tuple[TensorMeta, ...]
    bucket_size_bytes: int
    alignment: int
    capacity_bytes: int  # the size of one bucket slot; >= bucket_size_bytes
    buckets: tuple[Bucket, ...]
    layout_hash: str

    @property
    def total_bytes(self) -> int:
        """Bytes a round moves: the sum of the buckets' spans."""
        return sum(bucket.nbytes for bucket in self.buckets)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(t.nbytes for bucket in self.buckets for t in bucket.tensors)

    def to_json(self) -> str:
        """The layout's inputs; `from_json` re-plans them and checks the hash."""
        return json.dumps(
            {
                "bucket_size_bytes": self.bucket_size_bytes,
                "alignment": self.alignment,
                "tensors": [t.to_json() for t in self.tensors],
                "layout_hash": self.layout_hash,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> BucketLayout:
        data = json.loads(raw)
        layout = plan_layout(
            [TensorMeta.from_json(t) for t in data["tensors"]],
            bucket_size_bytes=int(data["bucket_size_bytes"]),
            alignment=int(data["alignment"]),
        )
        if layout.layout_hash != data["layout_hash"]:
            raise LayoutError(
                f"layout hash mismatch: sent {data['layout_hash']}, re-planned {layout.layout_hash}"
            )
        return layout


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def layout_hash(
    tensors: Iterable[TensorMeta], bucket_size_bytes: int, alignment: int = DEFAULT_ALIGNMENT
) -> str:
    """sha256 over the ordered names, shapes and dtypes and the bucket settings."""
    canonical = json.dumps(
        {
            "v": 1,
            "bucket_size_bytes": bucket_size_bytes,
            "alignment": alignment,
            "tensors": [t.to_json() for t in tensors],
        },
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def plan_layout(
    tensors: Sequence[TensorMeta],
    bucket_size_bytes: int,
    alignment: int = DEFAULT_ALIGNMENT,
) -> BucketLayout:
    """Pack `tensors`, in order, into buckets of at most `bucket_size_bytes` (see module doc)."""
    if bucket_size_bytes <= 0:
        raise LayoutError(f"bucket_size_bytes must be positive, got {bucket_size_bytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise LayoutError(f"alignment must be a positive power of two, got {alignment}")
    if not tensors:
        raise LayoutError("no tensors to lay out")
    seen: set[str] = set()
    for meta in tensors:
        if meta.name in seen:
            raise LayoutError(f"duplicate tensor name {meta.name!r}")
        seen.add(meta.name)

    largest = max(align_up(meta.nbytes, alignment) for meta in tensors)
    capacity = max(align_up(bucket_size_bytes, alignment), largest)

    buckets: list[Bucket] = []
    current: list[TensorSlice] = []
    offset = 0
    for meta in tensors:
        size = meta.nbytes
        if current and offset + size > bucket_size_bytes:
            buckets.append(Bucket(len(buckets), tuple(current), offset))
            current, offset = [], 0
        current.append(TensorSlice(meta.name, meta.dtype, meta.shape, offset, size))
        offset = align_up(offset + size, alignment)
    buckets.append(Bucket(len(buckets), tuple(current), offset))

    return BucketLayout(
        tensors=tuple(tensors),
        bucket_size_bytes=bucket_size_bytes,
        alignment=alignment,
        capacity_bytes=capacity,
        buckets=tuple(buckets),
        layout_hash=layout_hash(tensors, bucket_size_bytes, alignment),
    )
