"""Colocated as RL teams run it, on GPUs: two trainer ranks on GPUs 0 and 1 publish their
`Shard(0)` pieces over NCCL, their two source agents assemble each bucket, and a
reference engine of two tensor-parallel workers on the same GPUs serves it, worker w
loading only the copy on GPU w (CUDA IPC). The CPU tier's body
(`tests/integration/test_colocated_tp.py`): five versions bit for bit on both workers,
the engine's memory released between them and woken by the round, the engine restarted
in place reloaded by the lead without a round.

Run on a machine with 2 GPUs: `pytest -m multigpu tests/gpu/test_colocated_tp_nccl.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.integration.test_colocated_tp import RANKS, Setup, run_colocated_tp
from weightsync.api.control import Backend

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


@pytest.mark.timeout(420)
def test_every_rank_of_a_trainer_pod_feeds_one_tensor_parallel_engine_nccl(
    tmp_path: Path,
) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < RANKS:
        pytest.skip(f"{RANKS} trainer ranks and engine workers need {RANKS} GPUs, found {gpus}")
    run_colocated_tp(tmp_path, Setup(Backend.NCCL, tuple(f"cuda:{r}" for r in range(RANKS))))
