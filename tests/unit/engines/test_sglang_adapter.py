"""What only the SGLang adapter does: TP payloads, pause modes and the cache, crashes."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tests.unit.engines.fakes.sglang_server import SESSION_REQUIRED, FakeSGLang
from tests.unit.engines.harness import SGLANG, connected
from tests.unit.engines.support import make_model, run, zeros_like_model
from weightsync.engines.base import EngineError
from weightsync.engines.sglang import SGLANG_INJECTION, SGLangSettings


def test_tp2_sends_one_payload_per_rank_and_both_read_the_bucket() -> None:
    source = make_model(seed=5)
    fake = FakeSGLang(model=zeros_like_model(source), tp_size=2)

    async def scenario() -> None:
        async with connected(SGLANG, fake, tp_size=2) as link:
            await link.sync(source, 1)

    run(scenario())
    loads = [r for r in fake.controls.requests if r.path == "/update_weights_from_tensor"]
    assert loads
    assert all(len(r.body["serialized_named_tensors"]) == 2 for r in loads)
    for name, tensor in source.items():
        assert torch.equal(fake.model[name], tensor)


def test_tp_size_below_the_engine_crashes_its_scheduler() -> None:
    # SGLang indexes the payload list by TP rank: a missing entry kills the scheduler.
    source = make_model()
    fake = FakeSGLang(model=zeros_like_model(source), tp_size=2)

    async def scenario() -> None:
        async with connected(SGLANG, fake) as link:
            await link.adapter.begin_update(1)
            with pytest.raises(EngineError) as caught:
                await link.load_model(source, limit=1)
            assert caught.value.reason == "unreachable"
            health = await link.adapter.health()
            assert not health.healthy

    run(scenario())
    assert "IndexError" in fake.crash_reason


def test_parameter_the_model_lacks_is_refused_before_sglang_drops_it() -> None:
    # SGLang would skip the name and answer success: the adapter asks first.
    source = make_model()
    model = zeros_like_model(source)
    del model["lm_head.weight"]
    fake = FakeSGLang(model=model)

    async def scenario() -> None:
        async with connected(SGLANG, fake) as link:
            await link.adapter.begin_update(1)
            with pytest.raises(EngineError) as caught:
                await link.load_model(source)
            assert caught.value.reason == "bad_bucket"
            assert "lm_head.weight" in str(caught.value)
            await link.adapter.abort_update(1, "bad bucket")
            assert (await link.adapter.health()).healthy

    run(scenario())
    assert not fake.skipped
    assert not fake.controls.crashed


def test_shape_that_does_not_fit_is_refused_before_it_kills_sglang() -> None:
    source = make_model()
    model = zeros_like_model(source)
    model["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(16, 8, dtype=torch.bfloat16)
    fake = FakeSGLang(model=model)

    async def scenario() -> None:
        async with connected(SGLANG, fake) as link:
            await link.adapter.begin_update(1)
            with pytest.raises(EngineError) as caught:
                await link.load_model(source)
            assert caught.value.reason == "bad_bucket"
            assert "[16, 16]" in str(caught.value)
            assert "[?, 8]" in str(caught.value)
            await link.adapter.abort_update(1, "bad bucket")

    run(scenario())
    assert not fake.controls.crashed


def test_update_outside_the_session_is_refused_with_sglangs_message() -> None:
    source = make_model()
    fake = FakeSGLang(model=zeros_like_model(source))

    async def scenario() -> None:
        async with connected(SGLANG, fake) as link:
            await link.adapter.begin_update(1)
            fake.session_open = False  # someone else ended it
            with pytest.raises(EngineError) as caught:
                await link.load_model(source, limit=1)
            assert caught.value.reason == "rejected"
            assert SESSION_REQUIRED in str(caught.value)
            await link.adapter.abort_update(1, "refused")

    run(scenario())
    assert not fake.paused


def test_retract_keeps_requests_and_still_flushes_the_cache() -> None:
    source = make_model()
    fake = FakeSGLang(model=zeros_like_model(source))

    async def scenario() -> None:
        fake.set_running(3)
        async with connected(SGLANG, fake, pause_mode="retract") as link:
            await link.sync(source, 1)

    run(scenario())
    assert fake.waiting_requests == 3  # retracted, to be recomputed with the new weights
    assert "/flush_cache" in fake.controls.paths()
    assert fake.weight_version == "1"


def test_in_place_keeps_running_requests_and_skips_the_flush() -> None:
    source = make_model()
    fake = FakeSGLang(model=zeros_like_model(source))

    async def scenario() -> None:
        fake.set_running(2)
        async with connected(SGLANG, fake, pause_mode="in_place", flush_cache=False) as link:
            await link.sync(source, 1)

    run(scenario())
    assert fake.running_requests == 2
    assert "/flush_cache" not in fake.controls.paths()
    assert [r.body for r in fake.controls.requests if r.path == "/pause_generation"] == [
        {"mode": "in_place"}
    ]


def test_refused_flush_fails_the_round_and_marks_the_engine_torn() -> None:
    source = make_model()
    fake = FakeSGLang(model=zeros_like_model(source))

    async def scenario() -> None:
        async with connected(SGLANG, fake) as link:
            await link.adapter.begin_update(1)
            await link.load_model(source)
            fake.waiting_requests = 1  # arrived during an abort-mode pause
            with pytest.raises(EngineError) as caught:
                await link.adapter.finish_update(1)
            assert caught.value.reason == "rejected"
            await link.adapter.abort_update(1, "flush refused")
            health = await link.adapter.health()
            assert health.torn

    run(scenario())


def test_api_key_is_sent_as_a_bearer_token() -> None:
    fake = FakeSGLang(model={}, api_key="s3cret")

    async def scenario() -> None:
        async with connected(SGLANG, fake, api_key="s3cret") as link:
            health = await link.adapter.health()
            assert health.healthy
        async with connected(SGLANG, fake) as link:
            with pytest.raises(EngineError) as caught:
                await link.adapter.begin_update(1)
            assert caught.value.reason == "rejected"
            assert "401" in str(caught.value)

    run(scenario())


def test_settings_refuse_a_cache_flush_in_place_and_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="in_place"):
        SGLangSettings(base_url="http://e:30000", pause_mode="in_place")
    with pytest.raises(ValidationError, match="http"):
        SGLangSettings(base_url="e:30000")
    with pytest.raises(ValidationError, match="extra"):
        SGLangSettings.model_validate({"base_url": "http://e:30000", "pause": "abort"})
    assert SGLangSettings(base_url="http://e:30000/").base_url == "http://e:30000"


def test_injection_loads_dummy_weights() -> None:
    assert SGLANG_INJECTION.args == ["--load-format", "dummy"]
    assert SGLANG_INJECTION.merged_args(["--model-path", "m", "--load-format=auto"]) == [
        "--model-path",
        "m",
        "--load-format=auto",
    ]
    assert SGLANG_INJECTION.merged_args(["--model-path", "m"])[-2:] == ["--load-format", "dummy"]


def test_weightsync_pause_modes_map_to_sglangs() -> None:
    assert SGLangSettings.from_weightsync("http://e:30000").pause_mode == "abort"
    keep = SGLangSettings.from_weightsync("http://e:30000", pause_mode="Keep")
    assert keep.pause_mode == "retract"
    assert keep.flush_cache
    with pytest.raises(ValueError, match="drains"):
        SGLangSettings.from_weightsync("http://e:30000", pause_mode="Wait")
