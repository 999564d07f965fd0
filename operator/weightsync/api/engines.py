"""What each inference engine needs from its pod and its agent, as data. No torch, no HTTP.

* `EngineInjection`: flags and environment the admission webhook adds to an inference
  engine's container so weightsync can feed it (`INJECTIONS`, by the WeightSync's
  `engine` name; the Reference engine needs none).
* `PRIVATE_ROUTES`: the routes of each engine's public port that only its own agent
  may call, which the agent's front (`spec.inference[].front`) refuses to forward.
* `EngineOptions`: a WeightSync inference entry's engine options (`pauseMode`,
  `flushCache`), handed to the sink agent as JSON in `WEIGHTSYNC_ENGINE_OPTIONS`.
* `MemoryTag`: the regions an engine frees between Colocated rounds (vLLM's and SGLang's
  own tag names), and `released_tags`, which a `spec.colocated.memoryRelease` frees.

The operator and the engine adapters both read these, so they live in `api`, which the
controller may import (import-linter keeps it off `weightsync.engines`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, StrictBool

from weightsync.api.v1alpha1.colocated import MemoryRelease
from weightsync.api.v1alpha1.spec import InferenceSpec, PauseMode


class MemoryTag(StrEnum):
    """A region of engine memory that can be freed and brought back (vLLM's and SGLang's
    names for them)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


# Woken in this order inside a round: weights before the sync writes them, the KV cache
# after, so the GPU never holds the KV cache beside a model that is still arriving.
WAKE_ORDER = (MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)


def released_tags(release: MemoryRelease) -> frozenset[MemoryTag]:
    """The memory `release` frees."""
    if release is MemoryRelease.KV_CACHE:
        return frozenset({MemoryTag.KV_CACHE})
    if release is MemoryRelease.KV_CACHE_AND_WEIGHTS:
        return frozenset(MemoryTag)
    return frozenset()


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
    # What `spec.colocated.memoryRelease` (not None) needs on the command line: the flag
    # that lets the engine free its memory, and the spellings that turn it off again.
    release_flag: EngineFlag | None = None
    release_flag_off: tuple[str, ...] = ()

    @property
    def args(self) -> list[str]:
        return [part for flag in self.flags for part in flag.argv()]

    def merged_args(self, user_args: list[str]) -> list[str]:
        """`user_args` plus every injected flag the user did not set (`--x` or `--x=...`)."""
        present = {flag_name(arg) for arg in user_args if arg.startswith("--")}
        extra = [part for flag in self.flags if flag.name not in present for part in flag.argv()]
        return [*user_args, *extra]


def flag_name(arg: str) -> str:
    """A command-line flag's name as the engines' parsers read it: `--x=1` is `--x`, and
    vLLM's parser reads `--enable_sleep_mode` as `--enable-sleep-mode` (SGLang's refuses
    underscores, so the engine itself names that mistake)."""
    return arg.split("=", 1)[0].replace("_", "-")


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
    # SGLang 0.5.23 `server_args.py`: a store_true switch, no spelling that turns it off.
    release_flag=EngineFlag(
        "--enable-memory-saver",
        None,
        "spec.colocated.memoryRelease: /release_memory_occupation frees memory only in a "
        "server started with torch_memory_saver",
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
        "VLLM_SERVER_DEV_MODE": "mounts /pause, /resume, the weight-transfer routes and "
        "/sleep, /wake_up, /is_sleeping",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "lets workers unpickle ipc_handles_pickled, "
        "the only way IPC handles travel over HTTP",
    },
    # vLLM 0.32 `engine/arg_utils.py`: a BooleanOptionalAction, the last spelling wins.
    release_flag=EngineFlag(
        "--enable-sleep-mode",
        None,
        "spec.colocated.memoryRelease: /sleep and /wake_up need the CuMem allocator that "
        "sleep mode installs at start",
    ),
    release_flag_off=("--no-enable-sleep-mode",),
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


@dataclass(frozen=True, slots=True)
class PrivateRoutes:
    """Routes of an engine's public port that only the pod's own agent may call.

    `prefixes` match the start of a normalized, lower-case path (`/update_weights` covers
    `/update_weights_from_tensor`); `what` names them in the front's refusal.
    """

    what: str
    prefixes: tuple[str, ...]


# vLLM 0.32-0.33 (`vllm/entrypoints/rl/online/api_router.py`, `serve/dev/*`, `serve/*`):
# with VLLM_SERVER_DEV_MODE=1 these routes pause, reload, sleep and run code in the
# engine, and none is behind `--api-key`.
VLLM_PRIVATE_ROUTES = (
    PrivateRoutes(
        "vLLM's weight-transfer routes (the agent's rounds)",
        (
            "/pause", "/resume", "/is_paused", "/abort_requests",
            "/init_weight_transfer", "/shutdown_weight_transfer", "/start_weight_update",
            "/start_draft_weight_update", "/update_weight", "/finish_weight_update",
            "/weight_info", "/weight_checker", "/get_world_size",
        ),
    ),
    PrivateRoutes(
        "vLLM's development routes (VLLM_SERVER_DEV_MODE)",
        (
            "/collective_rpc", "/server_info", "/reconfigure", "/v1/runtime_config",
            "/suspend", "/is_suspended",
        ),
    ),
    PrivateRoutes(
        "vLLM's memory and cache routes",
        (
            "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory",
            "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
        ),
    ),
    PrivateRoutes(
        "vLLM's administration routes",
        (
            "/v1/admin", "/start_profile", "/stop_profile", "/scale_elastic_ep",
            "/is_scaling_elastic_ep", "/fault_tolerance", "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
        ),
    ),
)  # fmt: skip

# SGLang 0.5.23 (`python/sglang/srt/entrypoints/http_server.py`, `elastic_ep.py`): every
# route it marks `AuthLevel.ADMIN_OPTIONAL`, which is open to all unless the server has
# an `--admin-api-key`. `/model_info` and `/health`, which the adapter reads too, are
# public in SGLang and stay so.
SGLANG_PRIVATE_ROUTES = (
    PrivateRoutes(
        "SGLang's weight-update routes (the agent's rounds)",
        (
            "/pause_generation", "/continue_generation", "/abort_request",
            "/begin_weight_update", "/end_weight_update", "/update_weight",
            "/init_weights_update_group", "/destroy_weights_update_group",
            "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance",
            "/get_remote_instance_transfer_engine_info", "/remote_instance_transfer_engine_info",
            "/get_weights_by_name", "/weights_checker", "/load_lora_adapter",
            "/unload_lora_adapter",
        ),
    ),
    PrivateRoutes(
        "SGLang's memory and cache routes",
        (
            "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache",
            "/hicache", "/freeze_gc",
        ),
    ),
    PrivateRoutes(
        "SGLang's administration routes",
        (
            "/set_internal_state", "/dumper", "/start_profile", "/stop_profile",
            "/set_trace_level", "/start_expert_distribution_record",
            "/stop_expert_distribution_record", "/dump_expert_distribution_record",
            "/slow_down", "/pd_role_switch", "/configure_logging", "/add_external_corpus",
            "/remove_external_corpus", "/list_external_corpora", "/scale_elastic_ep",
            "/is_scaling_elastic_ep",
        ),
    ),
)  # fmt: skip

REFERENCE_PRIVATE_ROUTES = (
    PrivateRoutes("the reference engine's update and memory routes", ("/v1/update", "/v1/memory")),
)

PRIVATE_ROUTES: dict[str, tuple[PrivateRoutes, ...]] = {
    "VLLM": VLLM_PRIVATE_ROUTES,
    "SGLang": SGLANG_PRIVATE_ROUTES,
    "Reference": REFERENCE_PRIVATE_ROUTES,
}
"""By the WeightSync's `engine` name: what the agent's front refuses to forward."""
