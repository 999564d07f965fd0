"""The trainer's client on the torch releases `weightsync[client]` claims (pyproject.toml):
this venv's (2.11, every other tier) and the engines' venvs' (2.13 in vLLM's, 2.14 in
SGLang's), each with its own pydantic. A trainer's torch describes its DTensors and
publishes through an agent running on weightsync's own torch, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines_real import install
from tests.integration.contract import ContractConfig, apply_plan, start
from tests.integration.stack import free_port, stack
from weightsync.api.control import Backend

REPO = Path(__file__).resolve().parents[2]
CONFIG = ContractConfig(backend=Backend.GLOO, devices=["cpu", "cpu"], bucket_delay_seconds=0)
VENVS = ("vllm", "sglang")


def probe(venv: str, *args: str, timeout: float = 300) -> list[dict[str, Any]]:
    """`client_probe` with `venv`'s Python; its JSON lines (the first names its torch)."""
    python = install.install(install.ENGINES[venv])
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(python), "-m", "tests.engines_real.client_probe", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["torch"].split("+")[0] != torch.__version__.split("+")[0], lines[0]
    return lines


@pytest.mark.parametrize("venv", VENVS)
def test_dtensor_boxes_are_the_held_bytes_on_another_torch(venv: str, tmp_path: Path) -> None:
    probe(venv, "shards", str(tmp_path))
    reports = {p.name: json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))}
    assert len(reports) == 4
    assert all(problems == [] for problems in reports.values()), reports


@pytest.mark.parametrize("venv", VENVS)
def test_a_trainer_on_another_torch_publishes_bit_for_bit(venv: str, tmp_path: Path) -> None:
    with stack(tmp_path) as st:
        source, sinks = start(CONFIG, tmp_path, st)
        agents = [source, *sinks]
        apply_plan(CONFIG, agents, 1, free_port())  # and waits for it warm
        assert source.socket_path is not None
        published = probe(venv, "publish", str(source.socket_path), CONFIG.preset, "2")[1:]
        assert [(p["version"], p["ok"], p["reason"]) for p in published] == [
            (1, True, ""),
            (2, True, ""),
        ], published
        for sink in sinks:
            assert sink.engine is not None
            served = sink.engine.digests()
            assert served["version"] == 2
            assert served["tensors"] == published[-1]["tensors"]
