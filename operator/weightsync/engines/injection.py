"""What the operator adds to an inference engine's container so weightsync can feed it.

The data lives in `weightsync.api.engines` (torch-free, so the controller can read it);
this module keeps the engine package's names for it.
"""

from __future__ import annotations

from weightsync.api.engines import (
    INJECTIONS,
    SGLANG_INJECTION,
    VLLM_INJECTION,
    EngineFlag,
    EngineInjection,
)

__all__ = ["INJECTIONS", "SGLANG_INJECTION", "VLLM_INJECTION", "EngineFlag", "EngineInjection"]
