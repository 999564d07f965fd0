"""Whole rounds into a fake engine that runs in another process, on CPU and on CUDA.

The fake reads every bucket from the agent's slots through the handle in the request (CPU:
torch's file-system shared memory; CUDA: a CUDA IPC handle exported once per slot), while
the agent reuses its two slots bucket after bucket. The CUDA cases need a GPU (marker
`gpu`); CI runs the CPU ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
import torch

from tests.unit.engines.fakes.common import digest
from tests.unit.engines.harness import CASES, SLOT_BYTES, EngineCase, Link
from tests.unit.engines.support import buckets, make_model, pack, run

REPO = Path(__file__).resolve().parents[3]

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@contextmanager
def fake_process(engine: str, device: str, ranks: int = 1) -> Iterator[str]:
    path = [str(REPO), str(REPO / "operator"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    env["PYTHONWARNINGS"] = "ignore"
    with subprocess.Popen(
        [sys.executable, "-m", "tests.unit.engines.fakes.run_fake", engine, device, str(ranks)],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            line = child.stdout.readline()
            assert line.startswith("PORT "), f"fake did not start: {line!r}"
            yield f"http://127.0.0.1:{int(line.split()[1])}"
        finally:
            child.stdin.close()  # the fake stops when its stdin closes
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rounds_into_an_engine_in_another_process(case: EngineCase, device: str) -> None:
    rounds = [(1, make_model(seed=11)), (2, make_model(seed=12))]

    async def scenario(url: str) -> list[dict[str, str]]:
        seen: list[dict[str, str]] = []
        adapter = case.make_adapter(url)
        slots = [torch.zeros(SLOT_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
        await adapter.attach_buffers(slots)
        link = Link(adapter, slots, url)
        async with aiohttp.ClientSession() as session:
            for version, model in rounds:
                await link.sync(model, version)
                async with session.get(f"{url}/_fake/digests") as reply:
                    seen.append(await reply.json())
                health = await adapter.health()
                assert health.version == version
        await adapter.close()
        return seen

    with fake_process(case.name, device) as url:
        seen = run(scenario(url))
    for (_, model), engine_digests in zip(rounds, seen, strict=True):
        assert engine_digests == {name: digest(t) for name, t in model.items()}


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_copy_per_gpu_feeds_one_rank_per_gpu(case: EngineCase) -> None:
    """An agent with one rank per GPU holds each bucket on both GPUs; the adapter names
    both copies (SGLang: rank r's payload; vLLM: the UUID map) and each rank reads its own."""
    model = make_model(seed=21)

    async def scenario(url: str) -> dict[str, str]:
        settings = {"tp_size": 2} if case.name == "sglang" else {}
        adapter = case.make_adapter(url, **settings)
        per_gpu = [
            [torch.zeros(SLOT_BYTES, dtype=torch.uint8, device=f"cuda:{gpu}") for _ in range(2)]
            for gpu in (0, 1)
        ]
        # Grouped by device, in the same order on each: logical slot i is per_gpu[*][i].
        await adapter.attach_buffers([slot for group in per_gpu for slot in group], copies=2)
        await adapter.begin_update(1)
        for index, bucket in enumerate(buckets(model, SLOT_BYTES // 2)):
            slices = pack(per_gpu[0][index % 2], bucket, align=64)
            assert pack(per_gpu[1][index % 2], bucket, align=64) == slices  # the second GPU's copy
            await adapter.load_bucket(index % 2, slices)
        await adapter.finish_update(1)
        async with aiohttp.ClientSession() as session, session.get(f"{url}/_fake/digests") as r:
            result: dict[str, str] = await r.json()
        await adapter.close()
        return result

    with fake_process(case.name, "cuda", ranks=2) as url:
        seen = run(scenario(url))
    assert seen == {name: digest(t) for name, t in model.items()}
