"""A Colocated round with one copy, on CPU: the source round packs the trainer's tensors
straight into a real reference engine's staging arenas (shared memory here; CUDA IPC on
a GPU, where `test_rounds_nccl.py::test_colocated_cuda_ipc` runs the whole path).

What is not the real path here: the agent maps the Publisher's tensors by CUDA IPC only,
so this test hands the round the trainer's tensors in-process (`SourcePacker`). The
engine, its arenas, the adapter, the lane and the commit are the real ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from tests.integration.stack import Engine, free_port, stack
from tests.support.plans import local_plan
from weightsync.agent.direct_staging import DirectStagingRound
from weightsync.agent.generations import Generation
from weightsync.agent.group import GroupSpec, form_group
from weightsync.agent.packing import SourcePacker
from weightsync.agent.rounds import RoundOutcome
from weightsync.api.control import Backend, GenerationState, TransferOptions
from weightsync.api.v1alpha1 import SyncMode
from weightsync.engines.reference import ReferenceEngineAdapter
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import PRESETS, build_model
from weightsync.transfer.buffers import BucketSlots
from weightsync.transfer.layout import BucketLayout, TensorMeta, plan_layout

PRESET = "tiny"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    model = build_model(PRESETS[PRESET], seed, device="cpu")
    return {name: p.detach().clone() for name, p in model.named_parameters()}


async def _round(
    engine: Engine,
    layout: BucketLayout,
    tensors: dict[str, torch.Tensor],
    versions: list[int],
    shm: Path,
) -> list[RoundOutcome]:
    port = free_port()
    transfer = TransferOptions(bucket_size_bytes=layout.bucket_size_bytes, timeout_seconds=20.0)
    plan = local_plan(
        ["source-0"], 0, generation=1, port=port, backend=Backend.GLOO,
        transfer=transfer, mode=SyncMode.COLOCATED, prewarm_timeout_seconds=10.0,
    )  # fmt: skip
    spec = GroupSpec(
        sync_name="local", generation=1, rank=0, world_size=1, backend=Backend.GLOO,
        rendezvous_host="127.0.0.1", rendezvous_port=port, bind_host="127.0.0.1",
        device=torch.device("cpu"), collective_timeout_seconds=10.0,
        prewarm_timeout_seconds=10.0,
    )  # fmt: skip
    slots = BucketSlots(2, layout.capacity_bytes, torch.device("cpu"), str(shm))
    adapter = ReferenceEngineAdapter(engine.url)
    group = await form_group(spec)
    try:
        await adapter.attach_buffers(slots.slots)
        assert adapter.stages_directly  # the engine shares its arenas (shared memory)
        generation = Generation(plan, state=GenerationState.WARM, group=group)
        packer = SourcePacker(layout, [tensors[m.name] for m in layout.tensors])
        outcomes = []
        for version in versions:
            runner = DirectStagingRound(
                generation, layout, slots, version, None,
                lineage="L1", local_engine=adapter, engine_timeout_seconds=10.0, packer=packer,
            )  # fmt: skip
            outcomes.append(await runner.run())
        return outcomes
    finally:
        group.close()
        await adapter.close()
        slots.close()


def _metas(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [
        TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in tensors.items()
    ]


def test_a_direct_round_fills_the_engine_arenas_with_one_copy(tmp_path: Path) -> None:
    with stack(tmp_path) as st:
        engine = st.start_engine("engine", preset=PRESET, seed=0, device="cpu")
        st.wait_ready([], [engine])
        tensors = _tensors(seed=7)
        layout = plan_layout(_metas(tensors), 64 << 10)
        assert len(layout.buckets) > 2  # several buckets, arenas reused across rounds
        first = asyncio.run(_round(engine, layout, tensors, [1, 2, 3], tmp_path))
        assert [o.ok for o in first] == [True, True, True], first
        served = engine.digests()
        assert served["version"] == 3
        assert served["tensors"] == {name: tensor_digest(t) for name, t in tensors.items()}
        # Other bytes through the arenas the last rounds used: every byte is rewritten.
        for t in tensors.values():
            t.add_(1)
        again = asyncio.run(_round(engine, layout, tensors, [4], tmp_path))
        assert again[0].ok, again
        assert engine.digests()["tensors"] == {n: tensor_digest(t) for n, t in tensors.items()}


def test_a_bucket_the_engine_refuses_fails_the_round_and_keeps_the_served_version(
    tmp_path: Path,
) -> None:
    with stack(tmp_path) as st:
        engine = st.start_engine("engine", preset=PRESET, seed=0, device="cpu")
        st.wait_ready([], [engine])
        tensors = _tensors(seed=7)
        layout = plan_layout(_metas(tensors), 64 << 10)
        assert asyncio.run(_round(engine, layout, tensors, [1], tmp_path))[0].ok
        before = engine.digests()
        # A tensor the engine's model does not have: staging its bucket is refused.
        name = next(iter(tensors))
        wrong = dict(tensors)
        wrong[name] = torch.zeros(7, dtype=torch.float32)
        bad = plan_layout(_metas(wrong), 64 << 10)
        outcome = asyncio.run(_round(engine, bad, wrong, [2], tmp_path))[0]
        assert not outcome.ok
        assert outcome.reason.startswith("engine_"), outcome
        assert name in outcome.message, outcome
        assert engine.digests() == before  # still version 1, bit for bit
