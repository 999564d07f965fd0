"""A trainer into one engine of tensor-parallel workers, one body for gloo and NCCL.

The sink agent receives each bucket on the engine's first device and copies it to the
others (`agent.slot_pool`); worker w of the reference engine loads only from the copy
on its own device (its GPU, or on CPU the copy at its index). After every round every
worker's weights must be the trainer's, bit for bit: a copy that missed a bucket, or a
worker reading another's copy that was never filled, shows as a digest that differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.integration.contract import ContractConfig, apply_plan, expect_served
from tests.integration.stack import free_port, stack
from weightsync.api import agent_env
from weightsync.api.control import Backend
from weightsync.client import Publisher
from weightsync.reference.model import PRESETS, build_model, randomize


@dataclass(frozen=True)
class TensorParallelConfig:
    backend: Backend
    source_device: str  # the trainer's (and its agent's)
    engine_device: str  # the engine's first worker's; its sink agent receives there
    tp: int
    preset: str = "tiny"
    bucket_size_bytes: int = 16 << 10
    rounds: int = 3
    timeout_seconds: float = 20.0


@dataclass(frozen=True)
class TensorParallelRound:
    version: int
    seconds: float  # publish() until the sink committed on every worker
    bytes: int  # the round's bytes (each worker's copy holds all of them)
    loaded_bytes: dict[str, int]  # each worker's device -> the bytes it loaded


def run_tensor_parallel(config: TensorParallelConfig, workdir: Path) -> list[TensorParallelRound]:
    contract = ContractConfig(
        backend=config.backend,
        devices=[config.source_device, config.engine_device],
        preset=config.preset,
        bucket_size_bytes=config.bucket_size_bytes,
        timeout_seconds=config.timeout_seconds,
        bucket_delay_seconds=0.0,
    )
    rounds: list[TensorParallelRound] = []
    torch.manual_seed(0)
    with stack(workdir) as st:
        engine = st.start_engine(
            "engine-tp", preset=config.preset, seed=0, device=config.engine_device, tp=config.tp
        )
        sink = st.start_agent(
            "sink-tp",
            role="sink",
            device=config.engine_device,
            engine=engine,
            extra_env={agent_env.ENGINE_DEVICES: str(config.tp)},
        )
        source = st.start_agent("source-0", role="source", device=config.source_device)
        st.wait_ready([source, sink], [engine])
        apply_plan(contract, [source, sink], generation=1, port=free_port())

        trainer = build_model(PRESETS[config.preset], seed=0, device=config.source_device)
        payload = sum(p.numel() * p.element_size() for p in trainer.parameters())
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            for version in range(1, config.rounds + 1):
                randomize(trainer, seed=2000 + version)
                result = publisher.publish(trainer.named_parameters(), version=version)
                assert result.ok, result
                expect_served(trainer, [engine], version)
                workers = engine.digests()["workers"]
                assert len(workers) == config.tp
                if config.engine_device.startswith("cuda"):  # one worker per GPU
                    assert len({w["device"] for w in workers}) == config.tp
                loaded = {f"{i}:{w['device']}": w["loaded_bytes"] for i, w in enumerate(workers)}
                assert set(loaded.values()) == {payload}, loaded
                rounds.append(
                    TensorParallelRound(version, result.duration_seconds, result.bytes, loaded)
                )
        assert sink.status().version == config.rounds
    return rounds
