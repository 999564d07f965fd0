"""The agent builds its engine adapter with the WeightSync's engine options."""

from __future__ import annotations

import pytest

from weightsync.agent.engine_adapter import build_adapter
from weightsync.agent.settings import AgentSettings
from weightsync.engines.reference import ReferenceEngineAdapter
from weightsync.engines.sglang import SGLangAdapter
from weightsync.engines.vllm import VLLMAdapter

URL = "http://127.0.0.1:30000"


def settings(engine: str | None, options: str | None = None) -> AgentSettings:
    env = {"WEIGHTSYNC_TOKEN": "t", "WEIGHTSYNC_ENGINE_URL": URL}
    env["WEIGHTSYNC_ROLE"] = "sink" if engine else "source"
    if engine:
        env["WEIGHTSYNC_ENGINE"] = engine
    if options is not None:
        env["WEIGHTSYNC_ENGINE_OPTIONS"] = options
    return AgentSettings.from_env(env)


def test_sglang_and_vllm_adapters_take_pause_mode_and_flush_cache() -> None:
    sglang = build_adapter(settings("SGLang", '{"pause_mode": "Keep", "flush_cache": true}'))
    assert isinstance(sglang, SGLangAdapter)
    assert (sglang.settings.pause_mode, sglang.settings.flush_cache) == ("retract", True)
    vllm = build_adapter(settings("VLLM", '{"pause_mode": "Wait", "flush_cache": false}'))
    assert isinstance(vllm, VLLMAdapter)
    assert vllm.settings.flush_cache is False
    assert vllm.settings.pause_mode != build_adapter(settings("VLLM")).settings.pause_mode  # type: ignore[union-attr]


def test_the_reference_engine_is_built_from_its_url_and_a_source_has_none() -> None:
    assert isinstance(build_adapter(settings("Reference", "{}")), ReferenceEngineAdapter)
    assert build_adapter(settings(None)) is None


def test_invalid_options_are_a_settings_error() -> None:
    with pytest.raises(ValueError, match="pause_mode"):
        settings("SGLang", '{"pause_mode": "Sometimes"}')
    with pytest.raises(ValueError, match="cannot pause"):
        build_adapter(settings("SGLang", '{"pause_mode": "Wait"}'))
