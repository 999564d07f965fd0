"""Sharded sources on NCCL: several trainer GPUs publish their `Shard(0)` pieces.

The CPU tiers run this protocol on gloo, which cannot coalesce broadcasts; on NCCL each
bucket's segments travel as one NCCL group. Three trainer ranks cut the models unevenly,
and the engines must then serve every tensor bit for bit (`bench_sharded.check_bytes`
raises otherwise): the "uneven" preset in KiB buckets (many buckets, each with a
segment from every root), and one layer of Llama-3-8B's shapes in MiB buckets (pieces of
hundreds of MiB, whole tensors beside shards).
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from tests.bench.bench_broadcast import Shape
from tests.bench.bench_sharded import Bench, run_sharded
from weightsync.api.control import Backend

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("preset", "layers", "unit", "shapes"),
    [
        ("uneven", None, 1 << 10, [Shape(16, 2), Shape(64, 3)]),  # KiB: many buckets
        ("llama3-8b", 1, 1 << 20, [Shape(256, 2)]),
    ],
)
def test_sharded_sources_nccl_bit_identical(
    preset: str, layers: int | None, unit: int, shapes: list[Shape]
) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 3:
        pytest.skip(f"needs 3 GPUs (2 sources, 1 engine), found {gpus}")
    sources = 3 if gpus >= 4 else 2
    args = argparse.Namespace(
        sources=sources,
        gpus=min(gpus, 4),
        preset=preset,
        layers=layers,
        reps=2,
        holder=False,
        shapes=shapes,
    )
    configs = run_sharded(Bench(args, Backend.NCCL, unit=unit))
    assert [len(c.rounds) for c in configs] == [2] * len(shapes)
