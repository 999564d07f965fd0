"""Sharded sources on NCCL: several trainer GPUs publish their `Shard(0)` pieces.

The CPU tiers run this protocol on gloo, which cannot coalesce broadcasts; on NCCL each
bucket's segments travel as one NCCL group. Three trainer ranks cut the "uneven" preset
unevenly (pieces of odd sizes, segments of alternating roots in every bucket), KiB
buckets make many buckets per round, and the engines must then serve every tensor bit
for bit (`bench_sharded.check_bytes` raises otherwise).
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
def test_sharded_sources_nccl_bit_identical() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 3:
        pytest.skip(f"needs 3 GPUs (2 sources, 1 engine), found {gpus}")
    sources = 3 if gpus >= 4 else 2
    args = argparse.Namespace(
        sources=sources,
        gpus=min(gpus, 4),
        preset="uneven",
        layers=None,
        reps=2,
        holder=False,
        shapes=[Shape(16, 2), Shape(64, 3)],  # KiB: many buckets, two generations
    )
    configs = run_sharded(Bench(args, Backend.NCCL, unit=1 << 10))
    assert [len(c.rounds) for c in configs] == [2, 2]
