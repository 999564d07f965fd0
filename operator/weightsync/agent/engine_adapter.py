"""Build the agent's engine adapters: its own (settings), or a Colocated plan's local engine.

SGLang and vLLM adapters take their settings model (`SGLangSettings`, `VLLMSettings`),
built from the entry's `pauseMode` and `flushCache` by `from_weightsync`; every other
adapter (the Reference engine) is built from the base URL alone, as `engines` documents.
"""

from __future__ import annotations

import importlib

from weightsync.agent.settings import AgentSettings
from weightsync.api.engines import EngineOptions
from weightsync.api.v1alpha1 import Engine
from weightsync.engines import ADAPTERS, adapter_class
from weightsync.engines.base import EngineAdapter

# The engines whose adapters take the entry's pauseMode and flushCache.
SETTINGS_CLASSES = {Engine.SGLANG: "SGLangSettings", Engine.VLLM: "VLLMSettings"}


def build_adapter(settings: AgentSettings) -> EngineAdapter | None:
    """The adapter for `settings.engine`, or None for an agent without an engine."""
    if settings.engine is None:
        return None
    return adapter_for(settings.engine, settings.engine_url, settings.engine_options)


def adapter_for(engine: Engine, url: str, options: EngineOptions | None) -> EngineAdapter:
    """An adapter for `engine` at `url`; `options` reach SGLang and vLLM only."""
    cls = adapter_class(engine)
    settings_class = SETTINGS_CLASSES.get(engine)
    if options is None or settings_class is None:
        return cls(url)  # type: ignore[call-arg]
    module = importlib.import_module(ADAPTERS[engine][0])
    engine_settings = getattr(module, settings_class).from_weightsync(
        url, pause_mode=options.pause_mode.value, flush_cache=options.flush_cache
    )
    return cls(engine_settings)  # type: ignore[call-arg]
