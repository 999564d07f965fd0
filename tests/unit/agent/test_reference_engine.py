"""The reference engine's updates are staged: all or nothing, never a mix."""

from __future__ import annotations

import errno
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from weightsync.engines.base import EngineError
from weightsync.reference.engine import ReferenceEngine
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import PRESETS, build_model, state_dict_metas
from weightsync.transfer.buffers import BucketSlots, copy_tensors, slot_views
from weightsync.transfer.layout import BucketLayout, TensorSlice, plan_layout

CONFIG = PRESETS["tiny"]


def digests(engine: ReferenceEngine) -> dict[str, str]:
    return engine.digests()[1]


@pytest.fixture
def setup(tmp_path: Path) -> tuple[ReferenceEngine, BucketLayout, BucketSlots]:
    engine = ReferenceEngine(build_model(CONFIG, seed=0))
    layout = plan_layout(state_dict_metas(CONFIG, "float32"), 8 << 10)
    slots = BucketSlots(2, layout.capacity_bytes, torch.device("cpu"), str(tmp_path))
    engine.attach(slots.handles)
    return engine, layout, slots


def stream(
    engine: ReferenceEngine,
    layout: BucketLayout,
    slots: BucketSlots,
    seed: int,
    upto: int | None = None,
) -> None:
    source = dict(build_model(CONFIG, seed=seed).named_parameters())
    for bucket in layout.buckets[:upto]:
        slot = bucket.index % 2
        copy_tensors(
            slot_views(slots.slots[slot], bucket.tensors), [source[t.name] for t in bucket.tensors]
        )
        engine.load(slot, bucket.tensors)


def test_commit_swaps_in_the_new_version(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    engine, layout, slots = setup
    engine.begin(1)
    stream(engine, layout, slots, seed=5)
    engine.commit(1)
    want = {n: tensor_digest(p) for n, p in build_model(CONFIG, seed=5).named_parameters()}
    assert digests(engine) == want
    assert engine.health().version == 1
    # The freed buffers are reused for the next version without touching the served one.
    engine.begin(2)
    stream(engine, layout, slots, seed=6)
    assert digests(engine) == want
    engine.commit(2)
    assert digests(engine) != want


def test_abort_leaves_the_served_weights(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    engine, layout, slots = setup
    before = digests(engine)
    engine.begin(1)
    stream(engine, layout, slots, seed=9, upto=len(layout.buckets) // 2)
    engine.abort(1)
    assert digests(engine) == before
    assert engine.health().version is None
    with pytest.raises(EngineError, match="without begin"):
        engine.commit(1)


def test_incomplete_update_is_refused(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    engine, layout, slots = setup
    before = digests(engine)
    engine.begin(1)
    stream(engine, layout, slots, seed=9, upto=len(layout.buckets) - 1)
    with pytest.raises(EngineError) as error:
        engine.commit(1)
    assert error.value.reason == "incomplete_update"
    assert digests(engine) == before


def test_mismatched_tensors_are_refused(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    engine, layout, _ = setup
    engine.begin(1)
    wrong = layout.buckets[0].tensors[0]
    with pytest.raises(EngineError) as error:
        engine.load(0, [replace(wrong, shape=(1, wrong.nbytes // 4))])
    assert error.value.reason == "tensor_mismatch"
    with pytest.raises(EngineError) as error:
        engine.load(0, [replace(wrong, name="nope")])
    assert error.value.reason == "unknown_tensor"
    with pytest.raises(EngineError) as error:
        engine.load(5, [wrong])
    assert error.value.reason == "bad_slot"


def test_any_version_is_taken_and_each_process_is_an_incarnation_of_its_own(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    """A new lineage (a trainer restarted from an earlier step) publishes lower numbers:
    the engine takes them. A restarted engine names a new incarnation."""
    engine, layout, slots = setup
    engine.begin(3)
    stream(engine, layout, slots, seed=1)
    engine.commit(3)
    engine.begin(2)
    stream(engine, layout, slots, seed=2)
    engine.commit(2)
    assert engine.health().version == 2
    again = ReferenceEngine(build_model(CONFIG, seed=0))
    assert again.health().incarnation not in (None, engine.health().incarnation)


def test_generate_reports_its_version() -> None:
    engine = ReferenceEngine(build_model(CONFIG, seed=0), version=4)
    outputs, version = engine.generate([[1, 2], [3]], 3)
    assert version == 4
    assert [len(o) for o in outputs] == [3, 3]
    with pytest.raises(EngineError, match="token ids"):
        engine.generate([[CONFIG.vocab_size]], 1)


def test_rounds_after_the_first_reuse_the_staging_arenas(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    engine, layout, slots = setup
    for version, seed in [(1, 11), (2, 12), (3, 13)]:
        engine.begin(version)
        stream(engine, layout, slots, seed=seed)
        engine.commit(version)
        want = {n: tensor_digest(p) for n, p in build_model(CONFIG, seed=seed).named_parameters()}
        assert digests(engine) == want
        stats = engine.last_update
        assert stats is not None
        assert stats.loads == len(layout.buckets)
        assert stats.bytes == layout.payload_bytes
        # The first round stages into fresh arenas and sets up the next round's spares.
        assert (stats.allocated_bytes > 0) == (version == 1)


def test_an_aborted_round_then_a_full_one(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    engine, layout, slots = setup
    engine.begin(1)
    stream(engine, layout, slots, seed=21)
    engine.commit(1)
    served = digests(engine)
    engine.begin(2)
    stream(engine, layout, slots, seed=22, upto=len(layout.buckets) // 2)
    engine.abort(2)
    assert digests(engine) == served
    engine.begin(2)
    stream(engine, layout, slots, seed=23)
    assert digests(engine) == served  # staged, not served, until the commit
    engine.commit(2)
    want = {n: tensor_digest(p) for n, p in build_model(CONFIG, seed=23).named_parameters()}
    assert digests(engine) == want


def test_sparse_buckets_are_copied_tensor_by_tensor(tmp_path: Path) -> None:
    engine = ReferenceEngine(build_model(CONFIG, seed=0))
    source = dict(build_model(CONFIG, seed=31).named_parameters())
    names = list(source)
    gap = 64 << 10  # far more than alignment padding: not one span
    slot_bytes = sum(p.nbytes for p in source.values()) + gap * (len(names) + 1)
    slots = BucketSlots(1, slot_bytes, torch.device("cpu"), str(tmp_path))
    engine.attach(slots.handles)
    tensors, offset = [], gap
    for name in reversed(names):  # also out of slot order
        param = source[name]
        tensors.append(TensorSlice(name, "float32", tuple(param.shape), offset, param.nbytes))
        offset += param.nbytes + gap
    copy_tensors(slot_views(slots.slots[0], tensors), [source[t.name] for t in tensors])
    assert not engine.plan(tensors).dense
    engine.begin(1)
    engine.load(0, tensors)
    engine.commit(1)
    assert digests(engine) == {n: tensor_digest(p) for n, p in source.items()}


def test_buckets_that_contradict_themselves_are_refused(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    engine, _, _ = setup
    norms = [(n, p) for n, p in engine.params.items() if n.endswith("norm.weight")][:2]
    first, second = (
        TensorSlice(name, "float32", tuple(p.shape), 1024 * i, p.nbytes)
        for i, (name, p) in enumerate(norms)
    )
    engine.begin(1)
    with pytest.raises(EngineError) as error:
        engine.load(0, [first, replace(second, offset=first.offset)])
    assert error.value.reason == "bad_bucket"
    engine.load(0, [first])
    with pytest.raises(EngineError) as error:
        engine.load(1, [replace(first, offset=first.offset + first.nbytes + 256)])
    assert error.value.reason == "tensor_mismatch"


def test_a_new_layout_is_staged_beside_the_served_weights_not_beside_old_spares(
    setup: tuple[ReferenceEngine, BucketLayout, BucketSlots],
) -> None:
    engine, small, slots = setup
    for version in (1, 2):
        engine.begin(version)
        stream(engine, small, slots, seed=40 + version)
        engine.commit(version)
    small_bytes = engine.held_bytes // 2  # served + the next round's spares
    large = plan_layout(state_dict_metas(CONFIG, "float32"), 16 << 10)
    assert len(large.buckets) < len(small.buckets)
    engine.begin(3)
    stream(engine, large, slots, seed=43)
    staging = engine.held_bytes
    engine.commit(3)
    large_bytes = engine.held_bytes // 2
    # An engine that kept the old layout's spares would hold three copies of the model
    # here: a 61 GB MoE engine ran out of an 80 GB GPU that way.
    assert staging == small_bytes + large_bytes
    want = {n: tensor_digest(p) for n, p in build_model(CONFIG, seed=43).named_parameters()}
    assert digests(engine) == want


def test_no_room_to_stage_is_a_refusal_that_names_the_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = ReferenceEngine(build_model(CONFIG, seed=0), shm_dir=str(tmp_path))
    layout = plan_layout(state_dict_metas(CONFIG, "float32"), 8 << 10)

    def full(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("weightsync.reference.arenas.BucketSlots", full)
    engine.begin(1)
    first = layout.buckets[0].tensors
    with pytest.raises(EngineError, match=f"the bucket of {first[0].name}") as caught:
        engine.stage(engine.plan(first))
    assert caught.value.reason == "out_of_memory"
    engine.abort(1)
    assert engine.version is None
