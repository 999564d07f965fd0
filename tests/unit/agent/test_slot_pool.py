"""A sink's slots on each of its engine's devices: which devices, the copies, the replica."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from weightsync.agent.settings import AgentSettings
from weightsync.agent.slot_pool import SlotPool, slot_devices
from weightsync.engines._ipc import export_slots
from weightsync.transfer.buffers import SlotError, SlotHandles, describe_slots
from weightsync.transfer.layout import TensorMeta, plan_layout

CPU = torch.device("cpu")
LAYOUT = plan_layout([TensorMeta(f"w{i}", (256,), "float32") for i in range(6)], 2048)


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


@pytest.mark.parametrize(
    ("device", "asked", "visible", "expected"),
    [
        ("cpu", None, 0, [CPU]),
        ("cpu", 3, 0, [CPU] * 3),  # a CPU engine's workers: distinct shared-memory copies
        ("cuda:0", None, 4, [cuda(0), cuda(1), cuda(2), cuda(3)]),  # every GPU it sees
        ("cuda:1", None, 4, [cuda(1), cuda(2), cuda(3)]),
        ("cuda:0", 2, 4, [cuda(0), cuda(1)]),
        ("cuda:2", 2, 4, [cuda(2), cuda(3)]),
    ],
)
def test_the_engines_devices(
    device: str, asked: int | None, visible: int, expected: list[torch.device]
) -> None:
    assert slot_devices(device, asked, visible) == expected


@pytest.mark.parametrize(("device", "asked", "visible"), [("cuda:0", 3, 2), ("cuda:2", None, 2)])
def test_fewer_gpus_than_the_engine_has_is_a_clear_error(
    device: str, asked: int | None, visible: int
) -> None:
    with pytest.raises(SlotError, match=f"sees {visible}.*ResourceClaims"):
        slot_devices(device, asked, visible)


def test_engine_devices_is_a_sinks_setting() -> None:
    base = {"WEIGHTSYNC_TOKEN": "t", "WEIGHTSYNC_ENGINE_DEVICES": "2"}
    sink = AgentSettings.from_env({**base, "WEIGHTSYNC_ROLE": "sink", "WEIGHTSYNC_ENGINE": "VLLM"})
    assert sink.engine_devices == 2
    with pytest.raises(ValueError, match="sink agent's setting"):
        AgentSettings.from_env({**base, "WEIGHTSYNC_ROLE": "source"})


def test_copies_are_distinct_shared_memory_and_replicate_only_the_bucket(tmp_path: Path) -> None:
    pool = SlotPool([CPU, CPU, CPU], str(tmp_path))
    try:
        receiving = pool.ensure(LAYOUT, depth=2)
        assert pool.copy_count == 3
        engine_slots = pool.engine_slots()
        assert len(engine_slots) == 6  # grouped by device: copy c is [2c, 2c + 2)
        assert engine_slots[:2] == receiving.slots
        paths = [h.path for h in describe_slots(engine_slots).slots if h.kind == "shm"]
        assert len(set(paths)) == 6
        assert len({slot.data_ptr() for slot in engine_slots}) == 6

        bucket = LAYOUT.buckets[1]
        receiving.slots[1].copy_(torch.randint(0, 255, (receiving.capacity,), dtype=torch.uint8))
        for copy in pool.copies:
            copy.slots[1].fill_(7)
            copy.slots[0].fill_(9)
        asyncio.run(pool.replicate(1, bucket.nbytes).wait())
        for copy in pool.copies:
            assert torch.equal(copy.slots[1][: bucket.nbytes], receiving.slots[1][: bucket.nbytes])
            assert bool((copy.slots[1][bucket.nbytes :] == 7).all())  # past the bucket: untouched
            assert bool((copy.slots[0] == 9).all())  # the other slot: untouched
    finally:
        pool.close()
    assert not list(tmp_path.iterdir()), "every copy's shared memory is unlinked"


def test_a_larger_layout_reallocates_every_copy(tmp_path: Path) -> None:
    pool = SlotPool([CPU, CPU], str(tmp_path))
    try:
        first = pool.ensure(LAYOUT, depth=2)
        assert pool.ensure(LAYOUT, depth=2) is first
        epoch = pool.epoch
        larger = plan_layout([TensorMeta("big", (4096,), "float32")], 1 << 20)
        pool.ensure(larger, depth=2, staging_bytes=64)
        assert pool.epoch == epoch + 1
        assert {slot.numel() for slot in pool.engine_slots()} == {larger.capacity_bytes + 64}
        assert len(list(tmp_path.iterdir())) == 4  # the old ones are unlinked
    finally:
        pool.close()


def test_copies_added_later_keep_the_receiving_slots(tmp_path: Path) -> None:
    # A Colocated lead learns from its plan that its engine spans two devices: the slots
    # the Publisher maps stay, the copies are new and the engine must attach again.
    pool = SlotPool([CPU], str(tmp_path))
    try:
        slots = pool.ensure(LAYOUT, depth=2)
        epoch, engine_epoch = pool.epoch, pool.engine_epoch
        pool.use_devices([CPU, CPU])
        assert (pool.slots, pool.epoch, pool.copy_count) == (slots, epoch, 2)
        assert pool.engine_epoch == engine_epoch + 1
        assert [c.capacity for c in pool.copies] == [slots.capacity]
        pool.use_devices([CPU, CPU])  # the same devices: nothing changes
        assert pool.engine_epoch == engine_epoch + 1
        nbytes = LAYOUT.buckets[0].nbytes
        slots.slots[1][:nbytes].fill_(7)
        asyncio.run(pool.replicate(1, nbytes).wait())
        assert bool((pool.copies[0].slots[1][:nbytes] == 7).all())
        with pytest.raises(SlotError, match="cannot start"):
            pool.use_devices([torch.device("meta"), CPU])
    finally:
        pool.close()
    assert not list(tmp_path.iterdir())


def test_one_device_needs_no_copy(tmp_path: Path) -> None:
    pool = SlotPool([CPU], str(tmp_path))
    try:
        slots = pool.ensure(LAYOUT, depth=2)
        assert pool.engine_slots() == slots.slots
        asyncio.run(pool.replicate(0, LAYOUT.buckets[0].nbytes).wait())
    finally:
        pool.close()


def test_cpu_copies_are_keyed_by_position_for_the_engines(tmp_path: Path) -> None:
    pool = SlotPool([CPU, CPU], str(tmp_path))
    try:
        pool.ensure(LAYOUT, depth=2)
        logical = export_slots(pool.engine_slots(), copies=pool.copy_count)
        assert len(logical) == 2
        assert [c.key for c in logical[1].copies] == ["cpu:0", "cpu:1"]
        assert logical[1].copies[1].tensor.data_ptr() == pool.copies[0].slots[1].data_ptr()
        # Without `copies`, CPU slots are one device's: one copy, four slots.
        assert [len(s.copies) for s in export_slots(pool.engine_slots())] == [1] * 4
        with pytest.raises(ValueError, match="equal copies"):
            export_slots(pool.engine_slots()[:3], copies=2)

        handles = SlotHandles(slots=describe_slots(pool.engine_slots()).slots, copies=2)
        for position in (0, 1):
            mine = handles.copy_for(CPU, position)
            assert mine.slots == handles.slots[2 * position : 2 * position + 2]
        with pytest.raises(SlotError, match="no copy 2"):
            handles.copy_for(CPU, 2)
        single = SlotHandles(slots=handles.slots[:2])
        assert single.copy_for(CPU, 1) == single  # one copy serves every worker
    finally:
        pool.close()
