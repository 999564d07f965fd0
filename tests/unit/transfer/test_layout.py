"""Bucket layout: pure planning, no torch."""

from __future__ import annotations

import json

import pytest

from weightsync.transfer.layout import (
    DTYPE_ITEMSIZE,
    BucketLayout,
    LayoutError,
    TensorMeta,
    align_up,
    plan_layout,
)


def metas(*sizes: int, dtype: str = "uint8") -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", (size,), dtype) for i, size in enumerate(sizes)]


def check_invariants(layout: BucketLayout) -> None:
    """What every layout guarantees, whatever the input."""
    names = [t.name for b in layout.buckets for t in b.tensors]
    assert names == [m.name for m in layout.tensors], "caller's order, each tensor once"
    for index, bucket in enumerate(layout.buckets):
        assert bucket.index == index
        assert bucket.tensors, "no empty buckets"
        assert bucket.nbytes <= layout.capacity_bytes
        end = 0
        for t in bucket.tensors:
            assert t.offset % layout.alignment == 0
            assert t.offset >= end, "tensors do not overlap"
            end = t.offset + t.nbytes
        assert bucket.nbytes == align_up(end, layout.alignment)
        if len(bucket.tensors) > 1:
            assert end <= layout.bucket_size_bytes, "only a lone oversized tensor exceeds the size"


@pytest.mark.parametrize(
    ("sizes", "bucket_size", "expected"),
    [
        pytest.param((100, 100, 100), 1024, [[0, 256, 512]], id="all-fit-aligned"),
        pytest.param((256, 256, 256, 256), 512, [[0, 256], [0, 256]], id="exact-fill"),
        pytest.param((300, 300), 512, [[0], [0]], id="alignment-pushes-out"),
        pytest.param((10, 2000, 10), 512, [[0], [0], [0]], id="oversized-alone"),
        pytest.param((1,), 1, [[0]], id="one-byte"),
        pytest.param((0, 0, 5), 256, [[0, 0, 0]], id="empty-tensors"),
    ],
)
def test_offsets(sizes: tuple[int, ...], bucket_size: int, expected: list[list[int]]) -> None:
    layout = plan_layout(metas(*sizes), bucket_size)
    assert [[t.offset for t in b.tensors] for b in layout.buckets] == expected
    check_invariants(layout)


@pytest.mark.parametrize(
    ("sizes", "bucket_size", "capacity"),
    [
        pytest.param((100, 100), 1000, 1024, id="bucket-size-rounded-to-alignment"),
        pytest.param((5000, 10), 1024, 5120, id="largest-tensor-sets-capacity"),
        pytest.param((1024, 1024), 1024, 1024, id="exact"),
    ],
)
def test_capacity(sizes: tuple[int, ...], bucket_size: int, capacity: int) -> None:
    layout = plan_layout(metas(*sizes), bucket_size)
    assert layout.capacity_bytes == capacity
    check_invariants(layout)


@pytest.mark.parametrize("dtype", sorted(DTYPE_ITEMSIZE))
def test_dtype_sizes(dtype: str) -> None:
    layout = plan_layout([TensorMeta("x", (3, 7), dtype)], 1 << 20)
    assert layout.buckets[0].tensors[0].nbytes == 21 * DTYPE_ITEMSIZE[dtype]


@pytest.mark.parametrize("alignment", [1, 64, 256, 4096])
@pytest.mark.parametrize("bucket_size", [1000, 4096, 1 << 16])
def test_invariants_across_settings(alignment: int, bucket_size: int) -> None:
    sizes = [(i * 7919) % 9000 + 1 for i in range(60)]
    layout = plan_layout(metas(*sizes, dtype="float32"), bucket_size, alignment)
    check_invariants(layout)
    assert layout.payload_bytes == 4 * sum(sizes)


def test_hash_is_stable_and_sensitive() -> None:
    base = metas(10, 20, 30)
    first = plan_layout(base, 4096)
    assert plan_layout(list(base), 4096).layout_hash == first.layout_hash
    variants = [
        plan_layout(base, 8192),
        plan_layout(base, 4096, alignment=512),
        plan_layout([*base[:2], TensorMeta("t2", (31,), "uint8")], 4096),
        plan_layout([*base[:2], TensorMeta("t2", (30,), "int8")], 4096),
        plan_layout([*base[:2], TensorMeta("renamed", (30,), "uint8")], 4096),
        plan_layout([base[1], base[0], base[2]], 4096),
    ]
    assert len({v.layout_hash for v in variants} | {first.layout_hash}) == len(variants) + 1


def test_hash_is_pinned() -> None:
    # The hash crosses processes and versions of this code: changing it is a protocol change.
    layout = plan_layout([TensorMeta("w", (2, 3), "bfloat16")], 1024)
    canonical = (
        '{"v":1,"bucket_size_bytes":1024,"alignment":256,"tensors":[["w",[2,3],"bfloat16"]]}'
    )
    import hashlib

    assert layout.layout_hash == hashlib.sha256(canonical.encode()).hexdigest()


def test_json_round_trip() -> None:
    layout = plan_layout(metas(300, 5, 9000, 1), 4096)
    again = BucketLayout.from_json(layout.to_json())
    assert again == layout


def test_json_with_wrong_hash_is_refused() -> None:
    data = json.loads(plan_layout(metas(1, 2), 512).to_json())
    data["layout_hash"] = "0" * 64
    with pytest.raises(LayoutError, match="hash mismatch"):
        BucketLayout.from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("tensors", "bucket_size", "alignment", "message"),
    [
        pytest.param([], 1024, 256, "no tensors", id="empty"),
        pytest.param(metas(1), 0, 256, "positive", id="zero-bucket"),
        pytest.param(metas(1), 1024, 100, "power of two", id="odd-alignment"),
        pytest.param([TensorMeta("a", (1,), "uint8")] * 2, 1024, 256, "duplicate", id="dup"),
        pytest.param([TensorMeta("a", (1,), "float128")], 1024, 256, "dtype", id="dtype"),
        pytest.param([TensorMeta("a", (-1,), "uint8")], 1024, 256, "negative", id="neg-dim"),
    ],
)
def test_invalid(tensors: list[TensorMeta], bucket_size: int, alignment: int, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        plan_layout(tensors, bucket_size, alignment)


def test_llama_8b_shape() -> None:
    """The 8B-shaped state dict the benchmark uses: 291 tensors, 16.06 GB in bf16."""
    from tests.unit.transfer.llama_shapes import llama3_8b_metas

    tensors = llama3_8b_metas()
    layout = plan_layout(tensors, 512 << 20)
    assert len(tensors) == 291
    assert layout.payload_bytes == 16_060_522_496
    # The embedding (1.05 GB) is larger than a bucket: it sets the capacity and goes alone.
    assert layout.capacity_bytes == 128256 * 4096 * 2
    check_invariants(layout)
