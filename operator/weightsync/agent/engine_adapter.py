"""Build the agent's engine adapters: its own (settings), or a Colocated plan's local engine.

Every adapter is built the same way, `for_engine(url, options)`: SGLang and vLLM turn the
entry's `pauseMode` and `flushCache` into their settings model, the Reference engine has
no such options.
"""

from __future__ import annotations

from weightsync.agent.settings import AgentSettings
from weightsync.api.engines import EngineOptions
from weightsync.api.v1alpha1 import Engine
from weightsync.engines import adapter_class
from weightsync.engines.base import EngineAdapter


def build_adapter(settings: AgentSettings) -> EngineAdapter | None:
    """The adapter for `settings.engine`, or None for an agent without an engine."""
    if settings.engine is None:
        return None
    return adapter_for(settings.engine, settings.engine_url, settings.engine_options)


def adapter_for(engine: Engine, url: str, options: EngineOptions | None) -> EngineAdapter:
    """An adapter for `engine` at `url`; `options` reach SGLang and vLLM only."""
    return adapter_class(engine).for_engine(url, options)
