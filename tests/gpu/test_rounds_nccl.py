"""The data-plane contract on NCCL: the CPU contract's body with one GPU per rank.

Run on a machine with GPUs: `pytest -m gpu tests/gpu` (2 GPUs: one source, one sink;
4 GPUs: one source, three sinks). Engines hold their weights on their own GPU; the
Publisher shares its tensors once by CUDA IPC and the source agent packs its slots.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from tests.integration.colocated_release import run_colocated_release
from tests.integration.contract import ContractConfig, run_colocated, run_contract
from tests.integration.test_colocated_reload import run_colocated_reload
from weightsync.api.control import Backend
from weightsync.api.v1alpha1 import MemoryRelease
from weightsync.transfer.buffers import TensorSources, describe_sources, open_sources

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


@pytest.mark.timeout(180)
def test_colocated_engine_restarted_in_place_reloaded_gpu(tmp_path: Path) -> None:
    """CUDA IPC: the trainer's agent reloads a restarted engine from its held copy."""
    if gpus() < 1:
        pytest.skip("needs a GPU")
    run_colocated_reload(tmp_path, "cuda:0")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("release", [MemoryRelease.KV_CACHE, MemoryRelease.KV_CACHE_AND_WEIGHTS])
def test_colocated_engine_released_between_rounds_gpu(
    tmp_path: Path, release: MemoryRelease
) -> None:
    """The CPU tier's time-sharing body on one GPU: what the engine releases comes back to
    the device (the driver's free memory), and every round is bit-identical."""
    if gpus() < 1:
        pytest.skip("needs a GPU")
    run_colocated_release(tmp_path, "cuda:0", release, kv_cache_bytes=1 << 30)


Names = list[tuple[str, tuple[int, ...], str]]


def _digests(sources_json: str, names: Names, queue: object) -> None:
    tensors = open_sources(TensorSources.model_validate_json(sources_json), names)
    queue.put([_digest(t) for t in tensors])  # type: ignore[attr-defined]


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


@pytest.mark.timeout(120)
def test_publisher_tensors_are_read_by_another_process_through_shared_sources() -> None:
    if gpus() < 1:
        pytest.skip("needs a GPU")
    flat = torch.randn(1 << 20, device="cuda:0")  # tensors sharing one storage, as in FSDP
    tensors = {
        "a": flat[: 1 << 19].view(512, 1024),
        "b": flat[1 << 19 :],
        "c": torch.randn(3, 5, device="cuda:0").to(torch.bfloat16),
        "empty": torch.empty(0, 7, device="cuda:0"),
    }
    sources = describe_sources(list(tensors.values()))
    assert sources is not None
    assert len(sources.storages) == 2  # `a` and `b` share one; `empty` needs none
    assert sources.tensors[-1] == (-1, 0)
    assert describe_sources([flat.view(1024, 1024).t()]) is None  # not contiguous
    names = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_digests, args=(sources.model_dump_json(), names, queue))
    child.start()
    seen = queue.get(timeout=90)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert seen == [_digest(t) for t in tensors.values()]
