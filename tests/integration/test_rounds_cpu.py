"""The data-plane contract on gloo/CPU: real agents and engines as local processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.colocated_release import (
    run_colocated_release,
    run_release_across_agent_restart,
)
from tests.integration.contract import ContractConfig, run_colocated, run_contract
from tests.integration.tensor_parallel import TensorParallelConfig, run_tensor_parallel
from weightsync.api.control import Backend
from weightsync.api.v1alpha1 import MemoryRelease


@pytest.mark.timeout(150)
def test_rounds_gloo(tmp_path: Path) -> None:
    run_contract(ContractConfig(backend=Backend.GLOO, devices=["cpu"] * 4), tmp_path)


def test_colocated_handoff(tmp_path: Path) -> None:
    run_colocated(tmp_path, "cpu")


@pytest.mark.parametrize("release", [MemoryRelease.KV_CACHE, MemoryRelease.KV_CACHE_AND_WEIGHTS])
def test_colocated_engine_released_between_rounds(tmp_path: Path, release: MemoryRelease) -> None:
    run_colocated_release(tmp_path, "cpu", release)


@pytest.mark.parametrize("release", [MemoryRelease.KV_CACHE, MemoryRelease.KV_CACHE_AND_WEIGHTS])
def test_an_agent_restarted_while_its_engine_sleeps_wakes_it_in_order(
    tmp_path: Path, release: MemoryRelease
) -> None:
    run_release_across_agent_restart(tmp_path, "cpu", release)


@pytest.mark.timeout(180)
def test_an_engine_of_two_workers_gets_every_round_on_each(tmp_path: Path) -> None:
    """A sink with two slot copies (shared memory) feeds a reference engine of two
    tensor-parallel workers, each loading from its own copy: bit-exact on both."""
    config = TensorParallelConfig(
        backend=Backend.GLOO, source_device="cpu", engine_device="cpu", tp=2
    )
    rounds = run_tensor_parallel(config, tmp_path)
    assert [r.version for r in rounds] == [1, 2, 3]
