"""Build the agent's engine adapter from its settings, with the WeightSync's engine options.

SGLang and vLLM adapters take their settings model (`SGLangSettings`, `VLLMSettings`),
built from the entry's `pauseMode` and `flushCache` by `from_weightsync`; every other
adapter (the Reference engine) is built from the base URL alone, as `engines` documents.
"""

from __future__ import annotations

import importlib

from weightsync.agent.settings import AgentSettings
from weightsync.engines import ADAPTERS, adapter_class
from weightsync.engines.base import EngineAdapter

SETTINGS_CLASSES = {"SGLang": "SGLangSettings", "VLLM": "VLLMSettings"}


def build_adapter(settings: AgentSettings) -> EngineAdapter | None:
    """The adapter for `settings.engine`, or None for an agent without an engine."""
    if settings.engine is None:
        return None
    cls = adapter_class(settings.engine)
    options = settings.engine_options
    settings_class = SETTINGS_CLASSES.get(settings.engine)
    if options is None or settings_class is None:
        return cls(settings.engine_url)  # type: ignore[call-arg]
    module = importlib.import_module(ADAPTERS[settings.engine][0])
    engine_settings = getattr(module, settings_class).from_weightsync(
        settings.engine_url,
        pause_mode=options.pause_mode.value,
        flush_cache=options.flush_cache,
    )
    return cls(engine_settings)  # type: ignore[call-arg]
