"""vLLM adapter: vLLM's native weight-transfer API with its CUDA IPC backend, packed.

Targets vLLM 0.33.0 (PyPI release, commit 4ba787ec9), read in
`vllm/entrypoints/rl/online/api_router.py` (the RL routes, mounted only with
VLLM_SERVER_DEV_MODE=1), `vllm/distributed/weight_transfer/{base,ipc_engine,
packed_tensor,clients}.py`, `vllm/v1/worker/gpu_worker.py` (session checks),
`vllm/v1/engine/async_llm.py` and `vllm/entrypoints/serve/exception_handling/`.
vLLM is not imported.

Why IPC: the agent already holds each bucket in GPU memory on the engine's node, so
the "ipc" backend lets vLLM read it in place. "nccl" would make vLLM's workers join
a second process group with the agent and receive every byte again; "ipc" adds no
group and no copy beyond vLLM's own. Packed mode, because vLLM's unpacked mode hands the
loader views of the sender's memory that its layerwise reload may keep past the call,
which a reused slot would overwrite; packed mode clones each tensor out of the buffer.

On CPU (CI) CUDA IPC does not exist: when the agent's slots are its /dev/shm files, the
adapter names them to vLLM's "weightsync_shm" backend instead (a weight-transfer backend
registered through vLLM's plugin mechanism; the engine tests install it), with
`shm_path` and `shm_offset` in place of `ipc_handles_pickled`. Every call below is the
same; only the handle differs.

A round, as HTTP calls:

1. `GET /weight_info` reads the served `weight_version`.
2. `POST /pause?mode=abort|wait|keep`.
3. `POST /init_weight_transfer_engine {"init_info": {"packed": true}}` (cheap for IPC; sent
   every round so an engine restarted since the last one decodes packed buffers).
4. `POST /start_weight_update`; then `POST /update_weight_version {"new_version":
   "weightsync-partial-<v>"}` so a half-loaded engine says so itself.
5. Per bucket, one `POST /update_weights {"update_info": {...}}` per contiguous run of
   tensors in the slot: `names`, `dtype_names`, `shapes`, `tensor_sizes` and
   `ipc_handles_pickled`, a base64 pickle of {GPU UUID: `reduce_tensor` args} for the
   run's bytes (vLLM's packed consumer rebuilds that view and splits it by
   `tensor_sizes` from its first byte, so a gap between tensors starts a new run).
   vLLM synchronizes the device after each update, so a reply means the slot is free.
6. `POST /finish_weight_update {"weight_version": "<v>"}`, `POST /resume`, and
   `GET /weight_info` must report "<v>".
"""

from __future__ import annotations

import base64
import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from weightsync.api.engines import (
    VLLM_INJECTION,  # noqa: F401 - re-exported: its flags are this engine's
    MemoryTag,
)
from weightsync.api.reasons import EngineErrorReason
from weightsync.engines import _versions
from weightsync.engines._http import normalize_base_url
from weightsync.engines._ipc import check_slices
from weightsync.engines._rounds import Round, RoundAdapter
from weightsync.engines.base import EngineError
from weightsync.transfer.buffers import SlotError, describe_slots
from weightsync.transfer.layout import TensorSlice

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"


UPDATE_ALREADY_ACTIVE = "start_weight_update called while a weight update is already active"
# The weight-transfer backend that reads CPU bucket slots from /dev/shm, registered in vLLM
# by weightsync's plugin (`--weight-transfer-config '{"backend": "weightsync_shm"}'`).
SHM_BACKEND = "weightsync_shm"


class VLLMSettings(BaseModel):
    """How the adapter reaches one vLLM server and drives its updates."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field(description="vLLM's HTTP server, e.g. http://127.0.0.1:8000")
    api_key: SecretStr | None = Field(default=None, description="sent as a Bearer token")
    pause_mode: Literal["abort", "wait", "keep"] = Field(
        default="abort", description="/pause mode: abort, wait (drain) or keep (freeze)"
    )
    flush_cache: bool = Field(
        default=True,
        description="drop the prefix cache computed with the old weights: /pause clears it in "
        "abort and wait modes; in keep mode /reset_prefix_cache preempts the frozen requests "
        "(they recompute on the new weights) before resuming",
    )
    connect_timeout_seconds: float = Field(default=5.0, gt=0)
    control_timeout_seconds: float = Field(
        default=120.0, gt=0, description="pause (wait mode drains requests), start, finish"
    )
    load_timeout_seconds: float = Field(default=300.0, gt=0, description="one update_weights")
    health_timeout_seconds: float = Field(default=10.0, gt=0)

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return normalize_base_url(value)

    @classmethod
    def from_weightsync(
        cls, base_url: str, *, pause_mode: str = "Abort", flush_cache: bool = True
    ) -> VLLMSettings:
        """Settings for a WeightSync inference entry (its pauseMode and flushCache)."""
        return cls(
            base_url=base_url, pause_mode=VLLM_PAUSE_MODES[pause_mode], flush_cache=flush_cache
        )


# WeightSync's pauseMode -> vLLM's /pause mode (the same three behaviours).
VLLM_PAUSE_MODES: dict[str, Literal["abort", "wait", "keep"]] = {
    "Abort": "abort",
    "Wait": "wait",
    "Keep": "keep",
}


@dataclass(frozen=True, slots=True)
class _Run:
    """Tensors that lie back to back in a slot: one packed update."""

    start: int
    tensors: tuple[TensorSlice, ...]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.tensors)


def contiguous_runs(tensors: Sequence[TensorSlice]) -> list[_Run]:
    """Split a bucket into runs of back-to-back tensors, in offset order."""
    ordered = sorted(tensors, key=lambda item: item.offset)
    runs: list[_Run] = []
    current: list[TensorSlice] = []
    end = 0
    for item in ordered:
        if current and item.offset < end:
            raise EngineError(
                EngineErrorReason.BAD_BUCKET, f"{item.name} overlaps {current[-1].name}"
            )
        if current and item.offset != end:
            runs.append(_Run(start=current[0].offset, tensors=tuple(current)))
            current = []
        current.append(item)
        end = item.offset + item.nbytes
    runs.append(_Run(start=current[0].offset, tensors=tuple(current)))
    return runs


class VLLMAdapter(RoundAdapter[VLLMSettings]):
    """Feeds one vLLM server from the agent's bucket slots."""

    settings_class = VLLMSettings
    engine_name = "vLLM"
    # Its layerwise reload finishes a layer that got part of its tensors on uninitialized
    # memory. On 0.32 (CPU) a request answered while torn left NaN behind (KV-cache blocks,
    # it seems) that outlived the next complete round: the repaired engine answered token
    # 0 (NaN logits) in about one abort of four on a loaded machine.
    resumes_torn = False

    def __init__(self, settings: VLLMSettings | str) -> None:
        super().__init__(settings)
        self._shm_paths: list[tuple[str, int]] = []  # CPU slots: (/dev/shm file, bytes)

    @property
    def backend(self) -> str:
        """The vLLM weight-transfer backend the attached slots need: "ipc" for GPU slots,
        "weightsync_shm" for CPU slots in weightsync's shared memory."""
        return SHM_BACKEND if self._shm_paths else "ipc"

    async def attach_buffers(self, slots: Sequence[torch.Tensor], copies: int = 1) -> None:
        # CPU slots in weightsync's /dev/shm files are named by path: vLLM's plugin backend
        # reads them there, so no CUDA IPC handle and no staging copy is needed (and
        # every worker of a CPU engine reads the first copy: they share the host).
        self._shm_paths = []
        if slots and all(slot.device.type == "cpu" for slot in slots):
            try:
                handles = describe_slots(slots[: len(slots) // max(copies, 1)])
            except SlotError:
                pass  # plain CPU tensors: staged for a reader of torch's shm handles
            else:
                self._shm_paths = [(h.path, h.nbytes) for h in handles.slots if h.kind == "shm"]
                self._slots = []
                return
        await super().attach_buffers(slots, copies)

    async def _read_label(self, timeout_seconds: float) -> object:
        reply = await self._call("/weight_info", timeout_seconds, method="GET")
        return reply.json_object().get("weight_version")

    async def _write_label(self, label: str) -> None:
        await self._call("/update_weight_version", self._control_timeout, {"new_version": label})

    async def _pause(self) -> None:
        params: dict[str, str] = {"mode": self.settings.pause_mode}
        if not self.settings.flush_cache and self.settings.pause_mode != "keep":
            params["clear_cache"] = "false"  # deprecated in 0.33, still honoured
        await self._call("/pause", self._control_timeout, params=params)

    async def _resume(self) -> None:
        await self._call("/resume", self._control_timeout)

    async def _release(self, tags: frozenset[MemoryTag]) -> frozenset[MemoryTag]:
        # Level 1 drops the KV cache and moves the weights to host memory; level 2 drops
        # both. Either way the weights leave the GPU and are woken before the next round.
        level = "2" if MemoryTag.WEIGHTS in tags else "1"
        params = {"level": level, "mode": self.settings.pause_mode}
        await self._call("/sleep", self._control_timeout, params=params)
        return frozenset(MemoryTag)

    async def _wake(self, tag: MemoryTag) -> None:
        await self._call("/wake_up", self._control_timeout, params={"tags": tag.value})

    async def _read_released(self) -> frozenset[MemoryTag] | None:
        # A bool: true while any tag sleeps. Either level moved both off the GPU, and
        # waking a tag that is already awake is a logged no-op in vLLM 0.32
        # (`v1/executor/abstract.py` `wake_up`), so asleep reads as both.
        reply = await self._call("/is_sleeping", self._health_timeout, method="GET")
        asleep = reply.json_object().get("is_sleeping")
        if not isinstance(asleep, bool):
            raise EngineError(EngineErrorReason.BAD_REPLY, f"vLLM /is_sleeping answered {asleep!r}")
        return frozenset(MemoryTag) if asleep else frozenset()

    async def _open_session(self) -> None:
        timeout = self._control_timeout
        await self._call("/init_weight_transfer_engine", timeout, {"init_info": {"packed": True}})
        try:
            await self._call("/start_weight_update", timeout)
        except EngineError as err:
            # A session an earlier agent left open (it stopped mid-round): finish, retry.
            if UPDATE_ALREADY_ACTIVE not in str(err):
                raise
            log.warning("finishing a weight update left open on %s", self.settings.base_url)
            await self._close_session()
            await self._call("/start_weight_update", timeout)

    async def _close_session(self) -> None:
        # Finishing puts every layer that received nothing back on its old tensors; a
        # session left open would leave those layers on the meta device.
        await self._call("/finish_weight_update", self._control_timeout)

    async def _commit(self, version: int) -> None:
        label = _versions.served_label(version)
        await self._call("/finish_weight_update", self._control_timeout, {"weight_version": label})
        if self.settings.flush_cache and self.settings.pause_mode == "keep":
            # /pause leaves the cache alone in keep mode; frozen requests hold blocks, so
            # they are preempted (and recomputed on the new weights) for the reset to work.
            reply = await self._call(
                "/reset_prefix_cache",
                self._control_timeout,
                params={"reset_running_requests": "true"},
            )
            if reply.json_object().get("success") is not True:
                raise EngineError(
                    EngineErrorReason.REJECTED, f"vLLM /reset_prefix_cache: {reply.text}"
                )

    def bucket_requests(self, slot: int, tensors: Sequence[TensorSlice]) -> list[dict[str, Any]]:
        """The /update_weights bodies for a bucket in slot `slot`, one per contiguous run."""
        if self._shm_paths:
            return self._shm_requests(slot, tensors)
        if not 0 <= slot < len(self._slots):
            raise EngineError(
                EngineErrorReason.BAD_BUCKET, f"slot {slot} of {len(self._slots)} attached"
            )
        logical = self._slots[slot]
        check_slices(tensors, logical.nbytes)
        bodies: list[dict[str, Any]] = []
        for run in contiguous_runs(tensors):
            for copy in logical.copies:
                copy.stage(run.start, run.nbytes)
            # One entry per GPU holding a copy; each worker picks its own GPU's UUID.
            handles = {
                copy.key: copy.view(run.start, run.nbytes).rebuild_args() for copy in logical.copies
            }
            update_info = {
                "names": [item.name for item in run.tensors],
                "dtype_names": [item.dtype for item in run.tensors],
                "shapes": [list(item.shape) for item in run.tensors],
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii"),
                "tensor_sizes": [item.nbytes for item in run.tensors],
            }
            bodies.append({"update_info": update_info})
        return bodies

    def _shm_requests(self, slot: int, tensors: Sequence[TensorSlice]) -> list[dict[str, Any]]:
        if not 0 <= slot < len(self._shm_paths):
            raise EngineError(
                EngineErrorReason.BAD_BUCKET, f"slot {slot} of {len(self._shm_paths)} attached"
            )
        path, nbytes = self._shm_paths[slot]
        check_slices(tensors, nbytes)
        bodies: list[dict[str, Any]] = []
        for run in contiguous_runs(tensors):
            update_info = {
                "names": [item.name for item in run.tensors],
                "dtype_names": [item.dtype for item in run.tensors],
                "shapes": [list(item.shape) for item in run.tensors],
                "tensor_sizes": [item.nbytes for item in run.tensors],
                "shm_path": path,
                "shm_offset": run.start,
            }
            bodies.append({"update_info": update_info})
        return bodies

    async def _load(self, round_: Round, slot: int, tensors: Sequence[TensorSlice]) -> None:
        for body in self.bucket_requests(slot, tensors):
            round_.loads_attempted += 1
            try:
                await self._call("/update_weights", self.settings.load_timeout_seconds, body)
            except EngineError as err:
                # A worker whose update raised has ended its session (gpu_worker.py) and
                # left every layer it had not finished on the meta device.
                if err.reason in (EngineErrorReason.REJECTED, EngineErrorReason.ENGINE_FAILED):
                    round_.session_open = False
                    round_.load_failed = True
                raise

    async def _repair(self, round_: Round) -> None:
        if not round_.load_failed:
            return
        # The failed update closed the session with layers on the meta device; resuming
        # then lets the next request kill the engine core (seen with vLLM 0.32 on CPU). An
        # empty session, started and finished, puts those layers back on real tensors:
        # the ones that received nothing on their old weights.
        log.warning("restoring vLLM's model after a failed update on %s", self.settings.base_url)
        await self._call("/start_weight_update", self._control_timeout)
        await self._call("/finish_weight_update", self._control_timeout)

    async def close(self) -> None:
        # Let vLLM drop its mapping of the slots; best effort, the engine keeps running.
        if self._slots or self._shm_paths:
            try:
                await self._call("/shutdown_weight_transfer_engine", self._control_timeout)
            except EngineError as err:
                log.info("shutdown_weight_transfer_engine on %s: %s", self.settings.base_url, err)
        await super().close()
