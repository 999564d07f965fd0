"""What SGLang's and vLLM's adapters (`RoundAdapter`) do beyond the engine contract.

The contract every engine keeps (rounds, refusals, aborts, health) is
`tests/support/engine_contract.py`, run in `test_contract.py`; here, against each recorded
fake: the routes a round calls, the partial label, refusals before any request, request
timeouts, and faults only a fake can stage (a slow, unhealthy or racing engine).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.unit.engines.harness import CASES, EngineCase, connected
from tests.unit.engines.support import make_model, pack, run, zeros_like_model
from weightsync.engines.base import EngineError
from weightsync.transfer.layout import TensorSlice

pytestmark = pytest.mark.parametrize("case", CASES, ids=str)


def assert_model_equal(engine: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    assert engine.keys() == source.keys()
    for name, tensor in source.items():
        assert engine[name].dtype == tensor.dtype, name
        assert torch.equal(engine[name], tensor), name


def test_a_round_calls_the_engines_routes_in_order(case: EngineCase) -> None:
    source = make_model(seed=1)
    fake = case.make_fake(zeros_like_model(source))

    async def scenario() -> None:
        async with connected(case, fake) as link:
            await link.adapter.begin_update(7)
            count = await link.load_model(source)
            await link.adapter.finish_update(7)
        assert count >= 3
        # SGLang's adapter looks each tensor name up once before its first load.
        paths = [path for path in fake.controls.paths() if path != "/get_weights_by_name"]
        loads = paths.count(case.load_path)
        assert loads >= count
        assert paths[: len(case.begin_paths)] == list(case.begin_paths)
        finish = paths[len(case.begin_paths) + loads :][: len(case.finish_paths)]
        assert finish == list(case.finish_paths)

    run(scenario())


def test_calls_out_of_order_are_refused_before_any_request(case: EngineCase) -> None:
    source = make_model()
    fake = case.make_fake(zeros_like_model(source))

    async def scenario() -> None:
        async with connected(case, fake) as link:
            slices = pack(link.slots[0], list(source.items())[:1])
            with pytest.raises(EngineError):
                await link.adapter.load_bucket(0, slices)
            await link.adapter.begin_update(1)
            requests = len(fake.controls.requests)
            with pytest.raises(EngineError):
                await link.adapter.finish_update(2)
            assert len(fake.controls.requests) == requests
        assert case.load_path not in fake.controls.paths()

    run(scenario())


@pytest.mark.parametrize(
    ("slice_", "what"),
    [
        (TensorSlice("w", "float32", (4,), 4090, 16), "outside"),
        (TensorSlice("w", "float32", (4,), 2, 16), "multiple"),
        (TensorSlice("w", "float32", (4,), 0, 12), "nbytes"),
        (TensorSlice("w", "complex_float9", (4,), 0, 16), "dtype"),
    ],
)
def test_bucket_that_does_not_fit_the_slot_is_refused(
    case: EngineCase, slice_: TensorSlice, what: str
) -> None:
    fake = case.make_fake({"w": torch.zeros(4)})

    async def scenario() -> None:
        async with connected(case, fake) as link:
            await link.adapter.begin_update(1)
            with pytest.raises(EngineError) as caught:
                await link.adapter.load_bucket(0, [slice_])
            assert caught.value.reason == "bad_bucket"
            assert what in str(caught.value)
            with pytest.raises(EngineError):
                await link.adapter.load_bucket(5, [slice_])
        assert case.load_path not in fake.controls.paths()

    run(scenario())


def test_slow_engine_times_out_within_the_request_timeout(case: EngineCase) -> None:
    source = make_model()
    fake = case.make_fake(zeros_like_model(source))
    fake.controls.delays[case.load_path] = 5.0

    async def scenario() -> None:
        async with connected(case, fake, load_timeout_seconds=0.3) as link:
            await link.adapter.begin_update(1)
            started = time.monotonic()
            with pytest.raises(EngineError) as caught:
                await link.load_model(source, limit=1)
            elapsed = time.monotonic() - started
            assert caught.value.reason == "timeout"
            assert "0.3 s" in str(caught.value)
            assert elapsed < 2.0
            fake.controls.delays.clear()
            await link.adapter.abort_update(1, "timeout")

    run(scenario())


def test_engine_serving_another_version_after_finish_is_an_error(case: EngineCase) -> None:
    source = make_model()
    fake = case.make_fake(zeros_like_model(source))

    async def scenario() -> None:
        async with connected(case, fake) as link:
            await link.adapter.begin_update(4)
            await link.load_model(source)
            fake.report_version = "3"  # as if another writer raced us
            with pytest.raises(EngineError) as caught:
                await link.adapter.finish_update(4)
        assert caught.value.reason == "version_mismatch"
        assert "'3'" in str(caught.value)

    run(scenario())


def test_the_partial_label_marks_an_open_round_and_a_torn_engine(case: EngineCase) -> None:
    first, second = make_model(seed=1), make_model(seed=2)
    fake = case.make_fake(zeros_like_model(first))

    async def scenario() -> None:
        async with connected(case, fake) as link:
            await link.sync(first, 5)
            await link.adapter.begin_update(6)
            assert fake.weight_version == "weightsync-partial-6"
            assert fake.paused
            await link.adapter.abort_update(6, "trainer gave up")
            assert fake.weight_version == "5"  # nothing loaded: the old label is true
            await link.adapter.begin_update(7)
            await link.load_model(second, limit=1)
            await link.adapter.abort_update(7, "broadcast failed")
            torn = await link.adapter.health()
            assert fake.weight_version == "weightsync-partial-7"
            assert "mixed" in torn.detail
            await link.adapter.begin_update(8)
            await link.load_model(second, limit=1)
            # The agent dies here: the session stays open and the engine paused.
        assert fake.in_session
        assert fake.paused

    run(scenario())


def test_health_mid_round_reports_the_old_version_without_probing(case: EngineCase) -> None:
    source = make_model()
    fake = case.make_fake(zeros_like_model(source))

    async def scenario() -> None:
        async with connected(case, fake) as link:
            await link.sync(source, 3)
            await link.adapter.begin_update(4)
            probes = fake.controls.paths().count("/health")
            health = await link.adapter.health()
            assert fake.controls.paths().count("/health") == probes
            await link.adapter.abort_update(4, "test over")
        assert "loading version 4" in health.detail

    run(scenario())


def test_unhealthy_engine_is_reported(case: EngineCase) -> None:
    fake = case.make_fake({})
    fake.healthy = False

    async def scenario() -> None:
        async with connected(case, fake) as link:
            health = await link.adapter.health()
        assert not health.healthy
        assert health.version is None
        assert "503" in health.detail

    run(scenario())


def test_failed_begin_resumes_generation(case: EngineCase) -> None:
    fake = case.make_fake({})
    stall = case.begin_paths[-2]  # the call that opens the engine's session
    fake.controls.delays[stall] = 0.6

    async def scenario() -> None:
        async with connected(case, fake, control_timeout_seconds=0.3) as link:
            with pytest.raises(EngineError) as caught:
                await link.adapter.begin_update(1)
            assert caught.value.reason == "timeout"
            paths = fake.controls.paths()
            assert case.resume_path in paths[paths.index(stall) :]
            assert not fake.paused
            # The adapter holds no round open: the next round may begin.
            fake.controls.delays.clear()
            await asyncio.sleep(0.6)  # let the stalled call land first
            await link.adapter.begin_update(2)
            await link.adapter.abort_update(2, "test over")

    run(scenario())
