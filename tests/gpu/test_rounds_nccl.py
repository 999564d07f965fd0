"""The data-plane contract on NCCL: the CPU contract's body with one GPU per rank.

Run on a machine with GPUs: `pytest -m gpu tests/gpu` (2 GPUs: one source, one sink;
4 GPUs: one source, three sinks). Engines hold their weights on their own GPU; the
Publisher copies device to device into the source agent's CUDA IPC slots.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.integration.contract import ContractConfig, run_colocated, run_contract
from weightsync.api.control import Backend

pytestmark = pytest.mark.gpu

# NVLink multicast (NVLS) stays off: on shared hosts it can take GPUs out of service.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.multigpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_rounds_nccl(tmp_path: Path, world: int) -> None:
    if gpus() < world:
        pytest.skip(f"needs {world} GPUs, found {gpus()}")
    config = ContractConfig(
        backend=Backend.NCCL,
        devices=[f"cuda:{i}" for i in range(world)],
        preset="small",
        bucket_size_bytes=4 << 20,
        timeout_seconds=20.0,
    )
    run_contract(config, tmp_path)


@pytest.mark.timeout(180)
def test_colocated_cuda_ipc(tmp_path: Path) -> None:
    if gpus() < 1:
        pytest.skip("needs a GPU")
    run_colocated(tmp_path, "cuda:0")
