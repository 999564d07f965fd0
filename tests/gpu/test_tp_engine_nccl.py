"""A trainer GPU into one engine of tensor-parallel workers, on NCCL.

    pytest -m multigpu tests/gpu/test_tp_engine_nccl.py -s

The trainer and its agent on GPU 0; one reference engine with `tp` workers on GPUs
1..tp, its sink agent receiving on GPU 1 and copying each bucket to the workers' other
GPUs. Every worker's GPU must hold the trainer's weights bit for bit after every round.
3 GPUs run TP 2, 4 GPUs TP 2 and TP 3. Prints, per round, its time and the bytes each
worker's GPU loaded; the floor to compare with is `tests/bench/bench_broadcast.py`'s.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
import torch

from tests.integration.tensor_parallel import TensorParallelConfig, run_tensor_parallel
from weightsync.api.control import Backend

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

# NVLink multicast (NVLS) stays off: on shared hosts it can take GPUs out of service.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 3])
def test_every_worker_gpu_gets_its_copy(tmp_path: Path, tp: int) -> None:
    if gpus() < tp + 1:
        pytest.skip(f"TP {tp} and a trainer need {tp + 1} GPUs, found {gpus()}")
    config = TensorParallelConfig(
        backend=Backend.NCCL,
        source_device="cuda:0",
        engine_device="cuda:1",
        tp=tp,
        preset="small",
        bucket_size_bytes=4 << 20,
        rounds=5,
        timeout_seconds=30.0,
    )
    rounds = run_tensor_parallel(config, tmp_path)
    assert [r.version for r in rounds] == list(range(1, config.rounds + 1))
    for r in rounds:
        per_gpu = ", ".join(f"worker {w}: {n} B" for w, n in r.loaded_bytes.items())
        print(f"TP {tp} version {r.version}: {r.seconds * 1000:.1f} ms, {r.bytes} B; {per_gpu}")
    steady = statistics.median(r.seconds for r in rounds[1:])
    print(f"TP {tp}: median round after the first {steady * 1000:.1f} ms")
