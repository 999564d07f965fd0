"""The sharded broadcast benchmark's machinery on CPU (`bench_sharded --smoke`).

Three trainer ranks, so the "uneven" preset's vocabulary (250 rows) shards unevenly
(84, 84, 82), and one engine: real trainer, agent, engine and floor processes on gloo;
the bench itself fails unless the engine serves every tensor bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# About a minute of processes on 2 cores: kept out of CI (`pytest -m slow`), run before GPU time.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sharded_smoke_runs() -> None:
    argv = [
        sys.executable, "-m", "tests.bench.bench_sharded", "--smoke",
        "--sources", "3", "--gpus", "4", "--reps", "1", "--configs", "16x2",
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=220, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    assert "uneven first dims: 2" in output
    assert "1 engines serve version 3 bit for bit" in output
    assert "target publish <= 1.25x one-buffer floor, 16 KiB buckets, depth 2:" in output
