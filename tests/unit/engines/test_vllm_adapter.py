"""What only the vLLM adapter does: packed runs, worker failures, pause modes, init."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from tests.unit.engines.fakes.vllm_server import (
    INSECURE_REFUSED,
    NOT_CONFIGURED,
    RPC_FAILED,
    FakeVLLM,
)
from tests.unit.engines.harness import VLLM, connected
from tests.unit.engines.support import make_model, run, zeros_like_model
from weightsync.engines.base import EngineError
from weightsync.engines.vllm import VLLM_INJECTION, VLLMSettings, contiguous_runs
from weightsync.transfer.layout import TensorSlice


def test_runs_split_at_gaps_and_refuse_overlaps() -> None:
    a = TensorSlice("a", "float32", (4,), 0, 16)
    b = TensorSlice("b", "float32", (4,), 16, 16)
    c = TensorSlice("c", "bfloat16", (8,), 64, 16)
    runs = contiguous_runs([c, a, b])
    assert [(run.start, [t.name for t in run.tensors], run.nbytes) for run in runs] == [
        (0, ["a", "b"], 32),
        (64, ["c"], 16),
    ]
    with pytest.raises(EngineError, match="overlaps"):
        contiguous_runs([a, TensorSlice("x", "float32", (2,), 8, 8)])


def test_padded_bucket_becomes_several_packed_updates_bit_exact() -> None:
    source = make_model(seed=7)
    fake = FakeVLLM(model=zeros_like_model(source))

    async def scenario() -> None:
        async with connected(VLLM, fake) as link:
            await link.adapter.begin_update(1)
            buckets = await link.load_model(source, align=256)
            await link.adapter.finish_update(1)
            assert fake.controls.paths().count("/update_weights") > buckets

    run(scenario())
    assert fake.packed
    for name, tensor in source.items():
        assert torch.equal(fake.model[name], tensor)


def test_worker_failure_ends_the_session_and_leaves_the_engine_torn() -> None:
    source = make_model()
    model = zeros_like_model(source)
    del model["model.norm.weight"]
    fake = FakeVLLM(model=model)

    async def scenario() -> None:
        async with connected(VLLM, fake) as link:
            await link.adapter.begin_update(1)
            with pytest.raises(EngineError) as caught:
                await link.load_model(source)
            assert caught.value.reason == "engine_failed"
            assert RPC_FAILED in str(caught.value)
            assert "model.norm.weight" in str(caught.value)
            assert not fake.in_session  # the worker ended it
            assert fake.on_meta
            await link.adapter.abort_update(1, "load failed")
            health = await link.adapter.health()
        assert health.torn
        assert health.healthy
        assert not fake.on_meta

    run(scenario())
    # The model is put back on real tensors (an empty session); torn, it stays paused.
    paths = fake.controls.paths()
    failed = len(paths) - 1 - paths[::-1].index("/update_weights")
    assert paths[failed + 1 : failed + 3] == ["/start_weight_update", "/finish_weight_update"]
    assert "/resume" not in paths[failed:]
    assert fake.paused


def test_engine_without_insecure_serialization_refuses_the_handles() -> None:
    source = make_model()
    fake = FakeVLLM(model=zeros_like_model(source), allow_insecure_serialization=False)

    async def scenario() -> None:
        async with connected(VLLM, fake) as link:
            await link.adapter.begin_update(1)
            with pytest.raises(EngineError) as caught:
                await link.load_model(source, limit=1)
            assert INSECURE_REFUSED in str(caught.value)
            await link.adapter.abort_update(1, "misconfigured")

    run(scenario())


def test_engine_without_weight_transfer_config_fails_begin_and_resumes() -> None:
    fake = FakeVLLM(model={}, backend=None)

    async def scenario() -> None:
        async with connected(VLLM, fake) as link:
            with pytest.raises(EngineError) as caught:
                await link.adapter.begin_update(1)
            assert caught.value.reason == "engine_failed"
            assert NOT_CONFIGURED in str(caught.value)

    run(scenario())
    assert not fake.paused
    assert fake.weight_version == "default"


def test_worker_on_another_gpu_finds_no_handle() -> None:
    source = make_model()
    fake = FakeVLLM(model=zeros_like_model(source), device_keys=("GPU-6f1c",))

    async def scenario() -> None:
        async with connected(VLLM, fake) as link:
            await link.adapter.begin_update(1)
            with pytest.raises(EngineError, match=r"GPU-6f1c\. Available UUIDs: \['cpu'\]"):
                await link.load_model(source, limit=1)
            await link.adapter.abort_update(1, "wrong GPU")

    run(scenario())


def test_wait_mode_pause_lasts_until_requests_finish() -> None:
    source = make_model()
    fake = FakeVLLM(model=zeros_like_model(source))

    async def scenario() -> None:
        fake.set_running(2)
        async with connected(VLLM, fake, pause_mode="wait") as link:
            begin = asyncio.create_task(link.adapter.begin_update(1))
            await asyncio.sleep(0.2)
            assert not begin.done()
            fake.set_running(0)
            await begin
            await link.load_model(source)
            await link.adapter.finish_update(1)

    run(scenario())
    pauses = [r.query for r in fake.controls.requests if r.path == "/pause"]
    assert pauses == [{"mode": "wait"}]


def test_close_releases_the_engines_mapping() -> None:
    fake = FakeVLLM(model={})

    async def scenario() -> None:
        async with connected(VLLM, fake):
            pass

    run(scenario())
    assert fake.controls.paths()[-1] == "/shutdown_weight_transfer_engine"


def test_settings_and_injection() -> None:
    with pytest.raises(ValidationError):
        VLLMSettings(base_url="http://e:8000", pause_mode="retract")
    assert VLLM_INJECTION.args == [
        "--weight-transfer-config",
        '{"backend": "ipc"}',
        "--load-format",
        "dummy",
    ]
    assert VLLM_INJECTION.env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    assert set(VLLM_INJECTION.env_why) == set(VLLM_INJECTION.env)


def test_keep_mode_preempts_frozen_requests_to_flush_the_prefix_cache() -> None:
    source = make_model()
    fake = FakeVLLM(model=zeros_like_model(source))
    fake.prefix_cache_entries = 5

    async def scenario() -> None:
        fake.set_running(2)
        async with connected(VLLM, fake, pause_mode="keep") as link:
            await link.sync(source, 1)

    run(scenario())
    resets = [r.query for r in fake.controls.requests if r.path == "/reset_prefix_cache"]
    assert resets == [{"reset_running_requests": "true"}]
    paths = fake.controls.paths()
    assert paths.index("/finish_weight_update") < paths.index("/reset_prefix_cache")
    assert paths.index("/reset_prefix_cache") < paths.index("/resume")
    assert fake.prefix_cache_entries == 0
    assert fake.waiting_requests == 2  # preempted, to recompute on the new weights


@pytest.mark.parametrize(
    ("mode", "flush", "query", "entries_left"),
    [
        ("abort", True, {"mode": "abort"}, 0),
        ("wait", True, {"mode": "wait"}, 0),
        ("abort", False, {"mode": "abort", "clear_cache": "false"}, 5),
        ("keep", False, {"mode": "keep"}, 5),
    ],
)
def test_pause_clears_the_cache_unless_told_not_to(
    mode: str, flush: bool, query: dict[str, str], entries_left: int
) -> None:
    source = make_model()
    fake = FakeVLLM(model=zeros_like_model(source))
    fake.prefix_cache_entries = 5

    async def scenario() -> None:
        async with connected(VLLM, fake, pause_mode=mode, flush_cache=flush) as link:
            await link.sync(source, 1)

    run(scenario())
    assert [r.query for r in fake.controls.requests if r.path == "/pause"] == [query]
    assert "/reset_prefix_cache" not in fake.controls.paths()
    assert fake.prefix_cache_entries == entries_left


def test_weightsync_pause_modes_map_one_to_one() -> None:
    for api, engine in (("Abort", "abort"), ("Wait", "wait"), ("Keep", "keep")):
        settings = VLLMSettings.from_weightsync("http://e:8000", pause_mode=api, flush_cache=False)
        assert settings.pause_mode == engine
        assert settings.flush_cache is False
