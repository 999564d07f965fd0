"""What each inference engine needs from its pod and its agent, as data. No torch, no HTTP.

* `EngineInjection`: flags and environment the admission webhook adds to an inference
  engine's container so weightsync can feed it (`INJECTIONS`, by the WeightSync's
  `engine` name; the Reference engine needs none).
* `EngineOptions`: a WeightSync inference entry's engine options (`pauseMode`,
  `flushCache`), handed to the sink agent as JSON in `WEIGHTSYNC_ENGINE_OPTIONS`.

The operator and the engine adapters both read these, so they live in `api`, which the
controller may import (import-linter keeps it off `weightsync.engines`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, StrictBool

from weightsync.api.v1alpha1.spec import InferenceSpec, PauseMode


@dataclass(frozen=True, slots=True)
class EngineFlag:
    """One command-line flag and its value (None for a bare switch), with why it is set."""

    name: str
    value: str | None
    why: str

    def argv(self) -> list[str]:
        return [self.name] if self.value is None else [self.name, self.value]


@dataclass(frozen=True, slots=True)
class EngineInjection:
    """Flags and environment an engine needs to accept weights from a weightsync agent."""

    flags: tuple[EngineFlag, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    env_why: dict[str, str] = field(default_factory=dict)

    @property
    def args(self) -> list[str]:
        return [part for flag in self.flags for part in flag.argv()]

    def merged_args(self, user_args: list[str]) -> list[str]:
        """`user_args` plus every injected flag the user did not set (`--x` or `--x=...`)."""
        present = {arg.split("=", 1)[0] for arg in user_args if arg.startswith("--")}
        extra = [part for flag in self.flags if flag.name not in present for part in flag.argv()]
        return [*user_args, *extra]

    def merged_env(self, user_env: dict[str, str]) -> dict[str, str]:
        """The injected environment under the user's own values."""
        return {**self.env, **user_env}


SGLANG_INJECTION = EngineInjection(
    flags=(
        EngineFlag(
            "--load-format",
            "dummy",
            "the trainer's weights arrive by update_weights_from_tensor; starting from random "
            "weights skips reading a checkpoint, and the readiness gate keeps the pod out of "
            "Service endpoints until the first version is loaded",
        ),
    ),
)


VLLM_INJECTION = EngineInjection(
    flags=(
        EngineFlag(
            "--weight-transfer-config",
            '{"backend": "ipc"}',
            "create vLLM's CUDA IPC weight-transfer engine in every worker",
        ),
        EngineFlag(
            "--load-format",
            "dummy",
            "the trainer's weights arrive over IPC; starting from random weights skips "
            "reading a checkpoint, and the readiness gate keeps the pod out of Service "
            "endpoints until the first version is loaded",
        ),
    ),
    env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
    env_why={
        "VLLM_SERVER_DEV_MODE": "mounts /pause, /resume and the weight-transfer routes",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "lets workers unpickle ipc_handles_pickled, "
        "the only way IPC handles travel over HTTP",
    },
)


INJECTIONS: dict[str, EngineInjection] = {"SGLang": SGLANG_INJECTION, "VLLM": VLLM_INJECTION}


class EngineOptions(BaseModel):
    """A WeightSync inference entry's engine options, as the sink agent receives them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pause_mode: PauseMode = PauseMode.ABORT
    flush_cache: StrictBool = True

    @classmethod
    def of(cls, entry: InferenceSpec) -> EngineOptions:
        """The options of one `spec.inference` entry."""
        return cls(pause_mode=entry.pause_mode, flush_cache=entry.flush_cache)
