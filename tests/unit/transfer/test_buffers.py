"""Bucket slots in shared memory, opened by another process; views, copies, checksums."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from weightsync.transfer.broadcast import bucket_checksum
from weightsync.transfer.buffers import (
    LARGE_COPY_BYTES,
    BucketSlots,
    SlotError,
    SlotHandles,
    copy_tensors,
    describe_slots,
    describe_sources,
    open_slots,
    slot_views,
)
from weightsync.transfer.layout import TensorMeta, plan_layout


def _child_fill(handles_json: str, value: int) -> None:
    slots = open_slots(SlotHandles.model_validate_json(handles_json))
    for slot in slots:
        slot.fill_(value)


def test_other_process_writes_are_seen(tmp_path: Path) -> None:
    slots = BucketSlots(2, 4096, torch.device("cpu"), str(tmp_path))
    try:
        context = multiprocessing.get_context("spawn")
        child = context.Process(target=_child_fill, args=(slots.handles.model_dump_json(), 7))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert all(bool((slot == 7).all()) for slot in slots.slots)
    finally:
        slots.close()
    assert list(tmp_path.iterdir()) == [], "close unlinks the shared memory names"


def test_handles_are_plain_json(tmp_path: Path) -> None:
    slots = BucketSlots(3, 1024, torch.device("cpu"), str(tmp_path))
    try:
        handles = SlotHandles.model_validate_json(slots.handles.model_dump_json())
        assert [h.nbytes for h in handles.slots] == [1024] * 3
        assert describe_slots(open_slots(handles)) == handles
    finally:
        slots.close()


def test_foreign_tensors_cannot_be_described() -> None:
    with pytest.raises(SlotError, match="not backed"):
        describe_slots([torch.zeros(16, dtype=torch.uint8)])
    with pytest.raises(SlotError, match="1-D uint8"):
        describe_slots([torch.zeros(4, dtype=torch.float32)])


def test_opening_a_missing_slot_fails(tmp_path: Path) -> None:
    handles = SlotHandles.model_validate(
        {"slots": [{"kind": "shm", "path": str(tmp_path / "gone"), "nbytes": 64}]}
    )
    with pytest.raises(SlotError, match="does not exist"):
        open_slots(handles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_views_round_trip_tensors(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {
        "a": (torch.arange(15) % 7).to(dtype).reshape(3, 5),
        "b": torch.ones(2, 2, 2, dtype=dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }
    metas = [
        TensorMeta(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for n, t in tensors.items()
    ]
    layout = plan_layout(metas, 1 << 12)
    slots = BucketSlots(1, layout.capacity_bytes, torch.device("cpu"), str(tmp_path))
    try:
        bucket = layout.buckets[0]
        copy_tensors(slot_views(slots.slots[0], bucket.tensors), list(tensors.values()))
        reopened = open_slots(slots.handles)[0]
        for view, original in zip(
            slot_views(reopened, bucket.tensors), tensors.values(), strict=True
        ):
            assert view.dtype == original.dtype
            assert torch.equal(view, original)
    finally:
        slots.close()


def test_checksum_sees_one_flipped_byte() -> None:
    data = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    before = bucket_checksum(data)
    assert bucket_checksum(data.clone()) == before
    data[5000] ^= 1
    assert bucket_checksum(data) != before


def test_large_and_small_tensors_are_copied_alike() -> None:
    generator = torch.Generator().manual_seed(3)
    floats = LARGE_COPY_BYTES // 4
    sources = [
        torch.randn(floats + 3, generator=generator),  # copied on its own
        torch.randn(5, 7, generator=generator),  # batched
        torch.randn(2, floats, generator=generator).to(torch.bfloat16),  # on its own
        torch.randint(0, 1 << 30, (9,), generator=generator),  # batched
    ]
    destinations = [torch.full_like(s, 0) for s in sources]
    copy_tensors(destinations, sources)
    assert all(torch.equal(d, s) for d, s in zip(destinations, sources, strict=True))
    with pytest.raises(ValueError, match=r"shorter|longer"):
        copy_tensors(destinations[:1], sources)


def test_only_contiguous_tensors_on_one_gpu_are_shared_as_sources() -> None:
    # On CPU (and for tensors CUDA IPC cannot name) the Publisher packs the buckets itself.
    assert describe_sources([torch.zeros(4), torch.ones(2, 2)]) is None
    assert describe_sources([]) is None
