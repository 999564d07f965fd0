"""SGLang adapter: flattened buckets through SGLang's HTTP server, by CUDA IPC.

Targets SGLang 0.5.23 (PyPI release of the v0.5.23 tag), read in
`python/sglang/srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`,
`srt/managers/tokenizer_control_mixin.py`, `srt/managers/scheduler_components/
weight_updater.py`, `srt/model_executor/model_runner_components/weight_updater.py`,
`srt/weight_sync/tensor_bucket.py` and `srt/utils/common.py` (MultiprocessingSerializer,
SafeUnpickler). SGLang is not imported: the payload is built with torch alone.

A round, as HTTP calls (bodies are JSON):

1. `GET /model_info` reads the served `weight_version`.
2. `POST /pause_generation {"mode": ...}` (abort | retract | in_place).
3. `POST /begin_weight_update {}`: 0.5.23 refuses tensor updates outside such a session.
4. `POST /update_weight_version {"new_version": "weightsync-partial-<v>", ...}` so an
   engine left half-loaded says so itself.
5. Per bucket, `POST /update_weights_from_tensor` with `load_format: "flattened_bucket"`
   and one base64 `MultiprocessingSerializer` payload per TP rank: a pickled
   `{"flattened_tensor": <uint8 view of the slot>, "metadata": [...]}`. The tensor pickles
   as torch's `rebuild_cuda_tensor` call on the slot's CUDA IPC handle (device named by
   GPU UUID, as SGLang's own patched reducer does); each metadata record has the
   attributes of SGLang's `FlattenedTensorMetadata` (name, shape, dtype, start_idx,
   end_idx, numel) and is a `types.SimpleNamespace`, which SGLang's SafeUnpickler admits
   and its loader reads by attribute. `flush_cache` is false per bucket.
6. `POST /end_weight_update {}`, `POST /flush_cache`, `POST /update_weight_version
   {"new_version": "<v>"}`, `POST /continue_generation {}`, then `GET /model_info` must
   report "<v>".

Before a tensor name is first sent to an engine, the adapter asks SGLang's
`/get_weights_by_name` for one row of it: SGLang 0.5.23 logs and skips a name its model
does not have and still answers 200 (a round would commit a version with a tensor never
loaded), and a tensor of the wrong shape kills its scheduler. The lookup resolves names as
the loader does (q/k/v into qkv_proj, gate/up into gate_up_proj) and shows the tensor's
rank and every dimension but the first (a 1-D tensor is read whole, so all of it). The
answer is kept per name until the engine is unreachable (it may have restarted).

SGLang replies to a bucket only after every TP rank loaded it and dropped the rebuilt
tensor; torch's CUDA IPC receiver synchronizes its stream before it releases an opened
storage, so a reply means the slot may be reused.
"""

from __future__ import annotations

import base64
import logging
import pickle
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from weightsync.api.engines import (
    SGLANG_INJECTION,  # noqa: F401 - re-exported: its flags are this engine's
    MemoryTag,
)
from weightsync.api.reasons import EngineErrorReason
from weightsync.engines import _versions
from weightsync.engines._http import engine_message, normalize_base_url
from weightsync.engines._ipc import LogicalSlot, check_slices, metadata_record
from weightsync.engines._rounds import HTTP_OK, Round, RoundAdapter
from weightsync.engines.base import EngineError
from weightsync.transfer.layout import TensorSlice

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"


SESSION_ALREADY_OPEN = "a weight-update session is already open"

# WeightSync's pauseMode -> SGLang's PauseGenerationReqInput.mode. Keep is "retract":
# requests go back to the queue and continue on the new weights, their KV cache
# recomputed, so the cache can still be flushed ("in_place" keeps old KV and refuses a
# flush). SGLang has no mode that drains in-flight requests, so Wait has no mapping.
SGLANG_PAUSE_MODES: dict[str, Literal["abort", "retract", "in_place"]] = {
    "Abort": "abort",
    "Keep": "retract",
}


class SGLangSettings(BaseModel):
    """How the adapter reaches one SGLang server and drives its updates."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field(description="SGLang's HTTP server, e.g. http://127.0.0.1:30000")
    api_key: SecretStr | None = Field(
        default=None, description="sent as a Bearer token (--api-key / --admin-api-key)"
    )
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        default="abort", description="PauseGenerationReqInput.mode during an update"
    )
    flush_cache: bool = Field(
        default=True, description="flush the radix/KV cache computed with the old weights"
    )
    tp_size: int = Field(default=1, ge=1, description="SGLang's --tp-size: payloads per bucket")
    connect_timeout_seconds: float = Field(default=5.0, gt=0)
    control_timeout_seconds: float = Field(
        default=120.0, gt=0, description="pause (abort mode retries every second), versions"
    )
    load_timeout_seconds: float = Field(default=300.0, gt=0, description="one bucket")
    health_timeout_seconds: float = Field(
        default=30.0, gt=0, description="/health runs a one-token generation for up to 20 s"
    )

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return normalize_base_url(value)

    @classmethod
    def from_weightsync(
        cls, base_url: str, *, pause_mode: str = "Abort", flush_cache: bool = True
    ) -> SGLangSettings:
        """Settings for a WeightSync inference entry (its pauseMode and flushCache)."""
        if pause_mode not in SGLANG_PAUSE_MODES:
            raise ValueError(
                f"SGLang {SGLANG_VERSION} cannot pause with {pause_mode!r}: its pause_generation "
                "modes abort, retract or freeze requests, none stops admission and drains them"
            )
        mode = SGLANG_PAUSE_MODES[pause_mode]
        return cls(base_url=base_url, pause_mode=mode, flush_cache=flush_cache)

    @model_validator(mode="after")
    def _in_place_keeps_cache(self) -> SGLangSettings:
        if self.pause_mode == "in_place" and self.flush_cache:
            raise ValueError(
                "pause_mode in_place keeps running requests and their KV cache, so SGLang "
                "refuses to flush it; set flush_cache false or use abort/retract"
            )
        return self


class SGLangAdapter(RoundAdapter[SGLangSettings]):
    """Feeds one SGLang server from the agent's bucket slots."""

    settings_class = SGLangSettings
    engine_name = "SGLang"

    def __init__(self, settings: SGLangSettings | str) -> None:
        super().__init__(settings)
        # Tensor names SGLang's model was seen to hold, with the shape they were checked at.
        self._checked: dict[str, tuple[int, ...]] = {}
        self._ranks = self.settings.tp_size  # payloads per bucket

    async def _post_ok(self, path: str, body: Any, timeout_seconds: float) -> dict[str, Any]:
        """POST where SGLang answers {"success": bool, "message": str}."""
        reply = await self._call(path, timeout_seconds, body)
        result = reply.json_object()
        if result.get("success") is not True:
            raise EngineError(
                EngineErrorReason.REJECTED, f"SGLang {path}: {result.get('message', result)}"
            )
        return result

    async def _read_label(self, timeout_seconds: float) -> object:
        reply = await self._call("/model_info", timeout_seconds, method="GET")
        return reply.json_object().get("weight_version")

    async def _write_label(self, label: str) -> None:
        body = {"new_version": label, "abort_all_requests": False}
        await self._post_ok("/update_weight_version", body, self._control_timeout)

    async def _pause(self) -> None:
        await self._call(
            "/pause_generation", self._control_timeout, {"mode": self.settings.pause_mode}
        )

    async def _resume(self) -> None:
        await self._call("/continue_generation", self._control_timeout, {})

    async def _release(self, tags: frozenset[MemoryTag]) -> frozenset[MemoryTag]:
        # SGLang releases only an idle server (or a paused one, ignoring what waits), and
        # its release stops nothing itself: pause first, continue once fully awake.
        # Answers null on success, an error status otherwise (`--enable-memory-saver`).
        await self._pause()
        body = {"tags": sorted(tags)}
        try:
            await self._call("/release_memory_occupation", self._control_timeout, body)
        except EngineError:
            await self._resume()  # nothing was released: serve again
            raise
        return tags

    async def _awake(self) -> None:
        await self._resume()

    async def _wake(self, tag: MemoryTag) -> None:
        body = {"tags": [tag.value]}
        await self._call("/resume_memory_occupation", self._control_timeout, body)

    async def _open_session(self) -> None:
        try:
            await self._post_ok("/begin_weight_update", {}, self._control_timeout)
        except EngineError as err:
            # A session an earlier agent left open (it stopped mid-round): close, retry.
            if SESSION_ALREADY_OPEN not in str(err):
                raise
            log.warning("closing a weight-update session left open on %s", self.settings.base_url)
            await self._close_session()
            await self._post_ok("/begin_weight_update", {}, self._control_timeout)

    async def _close_session(self) -> None:
        await self._post_ok("/end_weight_update", {}, self._control_timeout)

    async def _commit(self, version: int) -> None:
        await self._close_session()
        if self.settings.flush_cache:
            await self._call("/flush_cache", self._control_timeout)
        await self._write_label(_versions.served_label(version))

    def _check_slots(self, slots: list[LogicalSlot]) -> None:
        copies = len(slots[0].copies)
        tp_size = self.settings.tp_size
        if copies not in (1, tp_size) and tp_size != 1:
            raise ValueError(
                f"slots are on {copies} devices but SGLang runs tp_size={tp_size}: "
                "give one device (every rank reads it) or one per rank"
            )
        # A copy on each of the engine's GPUs (a sink serves every GPU it sees): one rank
        # each, so an unset tp_size follows the pod's GPUs.
        self._ranks = copies if copies > 1 else tp_size

    def bucket_request(self, slot: int, tensors: Sequence[TensorSlice]) -> dict[str, Any]:
        """The /update_weights_from_tensor body for a bucket in slot `slot` (stages it)."""
        if not 0 <= slot < len(self._slots):
            raise EngineError(
                EngineErrorReason.BAD_BUCKET, f"slot {slot} of {len(self._slots)} attached"
            )
        logical = self._slots[slot]
        lo, hi = check_slices(tensors, logical.nbytes)
        metadata = [metadata_record(item, item.offset - lo) for item in tensors]
        for copy in logical.copies:
            copy.stage(lo, hi - lo)
        payloads: list[str] = []
        for rank in range(self._ranks):
            # Rank r reads the copy on the r-th GPU when there is one per rank. Each rank
            # gets its own pickle: a reader's rebuild consumes one sender reference.
            copy = logical.copies[rank if len(logical.copies) > 1 else 0]
            bucket = {"flattened_tensor": copy.view(lo, hi - lo), "metadata": metadata}
            raw = pickle.dumps(bucket, protocol=pickle.DEFAULT_PROTOCOL)
            payloads.append(base64.b64encode(raw).decode("ascii"))
        return {
            "serialized_named_tensors": payloads,
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "abort_all_requests": False,
        }

    async def _check_tensors(self, tensors: Sequence[TensorSlice]) -> None:
        """Refuse a bucket naming a tensor SGLang would drop or that does not fit."""
        for item in tensors:
            if self._checked.get(item.name) == item.shape:
                continue
            one_d = len(item.shape) == 1
            # A 1-D tensor (norms, biases) is small: read it whole to see its length.
            probe = {"name": item.name, "truncate_size": item.shape[0] + 1 if one_d else 1}
            try:
                reply = await self._http.request(
                    "POST", "/get_weights_by_name", timeout_seconds=self._control_timeout,
                    json_body=probe,
                )  # fmt: skip
            except EngineError as err:
                if err.reason == EngineErrorReason.UNREACHABLE:
                    self._checked.clear()
                raise
            if reply.status != HTTP_OK:
                raise EngineError(
                    EngineErrorReason.BAD_BUCKET,
                    f"SGLang's model has no parameter {item.name!r} ({engine_message(reply)}): "
                    "SGLang would skip it and report success",
                )
            seen = _probed_shape(reply.json())
            want = item.shape if one_d else (None, *item.shape[1:])
            if seen != want:
                raise EngineError(
                    EngineErrorReason.BAD_BUCKET,
                    f"{item.name}: the bucket holds shape {list(item.shape)}, SGLang's "
                    f"parameter has shape {_shape_text(seen)}; loading it would kill SGLang",
                )
            self._checked[item.name] = item.shape

    async def _load(self, round_: Round, slot: int, tensors: Sequence[TensorSlice]) -> None:
        await self._check_tensors(tensors)
        body = self.bucket_request(slot, tensors)
        round_.loads_attempted += 1
        await self._post_ok("/update_weights_from_tensor", body, self.settings.load_timeout_seconds)


def _probed_shape(value: object) -> tuple[int | None, ...]:
    """The shape a /get_weights_by_name answer shows: a list of floats (1-D, its length) or
    a list holding the first row, nested (None: the first dimension, not shown)."""
    if not isinstance(value, list):
        raise EngineError(EngineErrorReason.BAD_REPLY, f"/get_weights_by_name: {str(value)[:200]}")
    if not value or not isinstance(value[0], list):
        return (len(value),)
    inner: object = value[0]
    dims: list[int | None] = [None]
    while isinstance(inner, list):
        dims.append(len(inner))
        inner = inner[0] if inner else None
    return tuple(dims)


def _shape_text(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if dim is None else str(dim) for dim in shape) + "]"
