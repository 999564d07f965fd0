"""The reference engine with tensor-parallel workers: each loads from its own copy of the
slots, and an update lands on every worker or on none."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from weightsync.api.engines import MemoryTag
from weightsync.engines.base import EngineError
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import PRESETS, build_model, state_dict_metas
from weightsync.reference.tensor_parallel import DISAGREE, TensorParallelEngine
from weightsync.reference.tp_worker import WorkerSpec, worker_devices
from weightsync.transfer.buffers import BucketSlots, SlotHandles, copy_tensors, slot_views
from weightsync.transfer.layout import BucketLayout, plan_layout

CONFIG = PRESETS["tiny"]
SPEC = WorkerSpec("tiny", None, 0, "float32", "cpu")
LAYOUT = plan_layout(state_dict_metas(CONFIG, "float32"), 8 << 10)
PROMPTS = [[1, 2, 3], [200]]


def want(seed: int) -> dict[str, str]:
    return {n: tensor_digest(p) for n, p in build_model(CONFIG, seed=seed).named_parameters()}


@pytest.fixture(scope="module")
def engine() -> Iterator[TensorParallelEngine]:
    served = TensorParallelEngine(SPEC, 2)
    try:
        yield served
    finally:
        served.close()


@pytest.fixture
def copies(tmp_path: Path) -> Iterator[list[BucketSlots]]:
    made = [BucketSlots(2, LAYOUT.capacity_bytes, torch.device("cpu"), str(tmp_path)) for _ in "ab"]
    yield made
    for slots in made:
        slots.close()


def attach(engine: TensorParallelEngine, copies: list[BucketSlots]) -> None:
    handles = [h for slots in copies for h in slots.handles.slots]
    engine.attach(SlotHandles(slots=handles, copies=len(copies)))


def stream(
    engine: TensorParallelEngine,
    layout: BucketLayout,
    copies: list[BucketSlots],
    seeds: list[int],
) -> None:
    """Every bucket, copy c holding the weights of `seeds[c]`, each loaded once."""
    sources = [dict(build_model(CONFIG, seed=seed).named_parameters()) for seed in seeds]
    for bucket in layout.buckets:
        slot = bucket.index % 2
        for slots, source in zip(copies, sources, strict=True):
            views = slot_views(slots.slots[slot], bucket.tensors)
            copy_tensors(views, [source[t.name] for t in bucket.tensors])
        engine.load(slot, bucket.tensors)


def test_worker_devices() -> None:
    assert worker_devices("cuda:1", 3) == ["cuda:1", "cuda:2", "cuda:3"]
    assert worker_devices("cpu", 2) == ["cpu", "cpu"]


def test_every_worker_loads_its_own_copy(
    engine: TensorParallelEngine, copies: list[BucketSlots]
) -> None:
    attach(engine, copies)
    # Different bytes in each copy: each worker ends up with its own copy's weights.
    engine.begin(1)
    stream(engine, LAYOUT, copies, seeds=[5, 6])
    engine.commit(1)
    workers = engine.worker_digests()
    assert [w.tensors for w in workers] == [want(5), want(6)]
    assert [w.loaded_bytes for w in workers] == [LAYOUT.payload_bytes] * 2
    version, tensors = engine.digests()
    assert version == 1
    assert set(tensors.values()) == {DISAGREE}  # never reads as either model
    with pytest.raises(EngineError, match=DISAGREE):
        engine.generate(PROMPTS, 3)

    # The same bytes in both copies: every worker serves them, bit for bit.
    engine.begin(2)
    stream(engine, LAYOUT, copies, seeds=[7, 7])
    engine.commit(2)
    assert [w.tensors for w in engine.worker_digests()] == [want(7), want(7)]
    assert engine.digests() == (2, want(7))
    outputs, version = engine.generate(PROMPTS, 3)
    assert version == 2
    assert len(outputs) == len(PROMPTS)
    assert engine.health().healthy
    assert engine.health().version == 2


def test_an_incomplete_update_switches_no_worker(
    engine: TensorParallelEngine, copies: list[BucketSlots]
) -> None:
    attach(engine, copies)
    before = engine.worker_digests()
    engine.begin(3)
    half = replace(LAYOUT, buckets=LAYOUT.buckets[: len(LAYOUT.buckets) // 2])
    stream(engine, half, copies, seeds=[8, 8])
    with pytest.raises(EngineError, match="not loaded") as failed:
        engine.commit(3)
    assert failed.value.reason == "incomplete_update"
    assert "2 of 2 workers" in str(failed.value)
    engine.abort(3)
    after = engine.worker_digests()
    assert [(w.version, w.tensors) for w in after] == [(w.version, w.tensors) for w in before]
    assert engine.health().version == before[0].version


def test_workers_release_together_and_serve_again_only_after_a_round(
    engine: TensorParallelEngine, copies: list[BucketSlots]
) -> None:
    attach(engine, copies)
    engine.begin(4)
    stream(engine, LAYOUT, copies, seeds=[9, 9])
    engine.commit(4)
    engine.release(frozenset(MemoryTag))
    assert engine.health().detail == "sleeping: kv_cache, weights released"
    with pytest.raises(EngineError, match="cannot generate: sleeping"):
        engine.generate(PROMPTS, 1)
    engine.resume(frozenset({MemoryTag.WEIGHTS}))
    assert engine.health().detail == "sleeping: kv_cache released"
    engine.begin(5)
    stream(engine, LAYOUT, copies, seeds=[10, 10])
    engine.commit(5)
    engine.resume(frozenset({MemoryTag.KV_CACHE}))
    assert engine.health().detail == ""
    assert engine.digests() == (5, want(10))
    assert engine.generate(PROMPTS, 1)[1] == 5


def test_copies_must_match_the_workers(engine: TensorParallelEngine, tmp_path: Path) -> None:
    three = [BucketSlots(2, 4096, torch.device("cpu"), str(tmp_path)) for _ in range(3)]
    try:
        with pytest.raises(EngineError, match="3 copies of the slots for 2 workers"):
            attach(engine, three)
    finally:
        for slots in three:
            slots.close()


def test_a_worker_that_exits_fails_the_update_and_the_health(
    copies: list[BucketSlots],
) -> None:
    served = TensorParallelEngine(SPEC, 2, call_timeout_seconds=20.0)
    try:
        attach(served, copies)
        served.begin(1)
        victim = served._workers[1].process
        victim.kill()
        victim.join(10)
        with pytest.raises(EngineError) as failed:
            stream(served, LAYOUT, copies, seeds=[4, 4])
        assert failed.value.reason == "worker_lost"
        assert "worker 1 (cpu)" in str(failed.value)
        with pytest.raises(EngineError):
            served.commit(1)
        health = served.health()
        assert not health.healthy
        assert health.version is None
        assert "worker 1 (cpu) exited" in health.detail
    finally:
        served.close()
