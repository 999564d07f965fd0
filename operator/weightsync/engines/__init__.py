"""Engine adapters by engine name (the WeightSync `engine` field), imported lazily.

Every adapter is built one way, `adapter_class(engine).for_engine(base_url, options)`
(the agent and the engine contract tests both do). Lazy imports keep one engine's client
dependencies off agents that drive another.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from weightsync.api.v1alpha1 import Engine

if TYPE_CHECKING:
    from weightsync.engines.base import EngineAdapter

ADAPTERS: dict[Engine, tuple[str, str]] = {
    Engine.REFERENCE: ("weightsync.engines.reference", "ReferenceEngineAdapter"),
    Engine.SGLANG: ("weightsync.engines.sglang", "SGLangAdapter"),
    Engine.VLLM: ("weightsync.engines.vllm", "VLLMAdapter"),
}


def adapter_class(engine: Engine) -> type[EngineAdapter]:
    """The adapter class for `engine`; raises `KeyError` for an unknown name."""
    from weightsync.engines.base import EngineAdapter

    try:
        module_name, class_name = ADAPTERS[engine]
    except KeyError:
        raise KeyError(f"unknown engine {engine!r}; known: {sorted(ADAPTERS)}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, EngineAdapter)):
        raise TypeError(f"{module_name}.{class_name} is not an EngineAdapter")
    return cls
