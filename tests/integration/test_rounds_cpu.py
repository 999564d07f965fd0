"""The data-plane contract on gloo/CPU: real agents and engines as local processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.contract import ContractConfig, run_colocated, run_contract
from weightsync.api.control import Backend


@pytest.mark.timeout(150)
def test_rounds_gloo(tmp_path: Path) -> None:
    run_contract(ContractConfig(backend=Backend.GLOO, devices=["cpu"] * 4), tmp_path)


def test_colocated_handoff(tmp_path: Path) -> None:
    run_colocated(tmp_path, "cpu")
