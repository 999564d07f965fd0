"""A fake vLLM 0.33.0 server: the RL weight-transfer routes with the IPC backend, strictly.

Routes and bodies follow vllm/entrypoints/rl/online/api_router.py (Body(embed=True): one
top-level key per parameter). Worker-side checks and messages follow
vllm/v1/worker/gpu_worker.py and vllm/distributed/weight_transfer/ipc_engine.py; a worker
exception reaches the client as vLLM's utility-call failure, "Call to collective_rpc
method failed: <error>", in a 500 `ErrorResponse` {"error": {"message", "type":
"InternalServerError", "param": null, "code": 500}} (v1/engine/core.py, core_client.py,
entrypoints/serve/exception_handling). Unknown keys inside `update_info` fail there too,
as the dataclass constructor's TypeError. Unknown top-level body keys, which FastAPI
ignores, are rejected here with vLLM's 400 validation shape unless
`strict_unknown_fields=False`.

`update_weights` is served for real in packed mode: `ipc_handles_pickled` is unpickled
(through the same allow-list as the SGLang fake, stricter than vLLM's `pickle.loads`), the
buffer is rebuilt from the handle of this worker's device key, cut to sum(tensor_sizes),
split, viewed, cloned and copied into `model`. Device keys are GPU UUIDs; CPU slots, which
vLLM's IPC backend cannot read, travel as torch's shared-memory tensor handle under the
key "cpu" so that CI can check the bytes.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError
from torch.multiprocessing import reductions

from tests.unit.engines.fakes.common import (
    NOT_JSON,
    FakeControls,
    apply_to_model,
    digests_route,
    local_cuda_index,
    logging_middleware,
    read_json_body,
    restricted_loads,
)

_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")

RPC_FAILED = "Call to collective_rpc method failed: "
WORKER_FAILED = (
    "Worker failed with error '{}', please check the stack trace above for the root cause"
)
NOT_CONFIGURED = (
    "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
)
ALREADY_ACTIVE = (
    "start_weight_update called while a weight update is already active. "
    "Call finish_weight_update first."
)
NOT_STARTED = "start_weight_update must be called before update_weights."
FINISH_WITHOUT_START = "finish_weight_update called without a matching start_weight_update."
INSECURE_REFUSED = (
    "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
)
PAUSE_MODES = ("abort", "wait", "keep")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitBody(_Body):
    init_info: dict[str, Any]


class UpdateBody(_Body):
    update_info: dict[str, Any] | list[dict[str, Any]]


class FinishBody(_Body):
    weight_version: str | None = None


class VersionBody(_Body):
    new_version: str


@dataclass
class IPCWeightTransferInitInfo:
    packed: bool = False


@dataclass
class IPCWeightTransferUpdateInfo:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: Any = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list[int] | None = None


class _WorkerError(Exception):
    """An exception in a worker: the client sees RPC_FAILED + str(error)."""


@dataclass
class FakeVLLM:
    model: dict[str, torch.Tensor]
    device_keys: tuple[str, ...] = ("cpu",)  # one worker per key (TP ranks)
    backend: str | None = "ipc"  # --weight-transfer-config backend; None: not configured
    allow_insecure_serialization: bool = True
    strict_unknown_fields: bool = True
    weight_version: str = "default"
    report_version: str | None = None  # /weight_info says this instead (version mismatch)
    paused: bool = False
    pause_mode: str | None = None
    running_requests: int = 0
    waiting_requests: int = 0
    prefix_cache_entries: int = 0  # cached prefixes; /pause (abort, wait) clears them
    packed: bool = False
    update_active: bool = False
    # A failed update leaves unfinished layers on the meta device; a start + finish puts
    # them back. Resuming before that kills the engine core (vLLM 0.32 on CPU, seen twice).
    on_meta: bool = False
    healthy: bool = True
    loaded: list[str] = field(default_factory=list)
    controls: FakeControls = field(default_factory=FakeControls)
    _requests_done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def in_session(self) -> bool:
        return self.update_active

    def app(self) -> web.Application:
        app = web.Application(middlewares=[logging_middleware(self.controls)])
        app.router.add_get("/health", self._health)
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_get("/is_paused", self._is_paused)
        # Development mode's sleep routes: this fake never sleeps (no /sleep), so it
        # answers as an awake vLLM does (`entrypoints/serve/dev/sleep/api_router.py`).
        app.router.add_get("/is_sleeping", self._is_sleeping)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_post("/init_weight_transfer_engine", self._init)
        app.router.add_post("/start_weight_update", self._start)
        app.router.add_post("/update_weights", self._update)
        app.router.add_post("/finish_weight_update", self._finish)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_post("/shutdown_weight_transfer_engine", self._shutdown)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_get("/_fake/digests", digests_route(self.model))
        return app

    async def _parse(
        self, request: web.Request, model: type[_M], *, optional: bool = False
    ) -> _M | web.Response:
        present, body = await read_json_body(request)
        if not present:
            if optional:
                return model()
            body = {}
        if body is NOT_JSON:
            return _validation_error([{"type": "json_invalid", "loc": ("body",), "msg": "JSON"}])
        if isinstance(body, dict) and not self.strict_unknown_fields:
            body = {key: value for key, value in body.items() if key in model.model_fields}
        try:
            return model.model_validate(body)
        except ValidationError as err:
            return _validation_error(
                [
                    {"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"]}
                    for e in err.errors(include_url=False)
                ]
            )

    def set_running(self, count: int) -> None:
        """In-flight requests (a test's stand-in for traffic)."""
        self.running_requests = count
        if count:
            self._requests_done.clear()
        else:
            self._requests_done.set()

    def _check_configured(self) -> None:
        if self.backend is None:
            raise _WorkerError(NOT_CONFIGURED)

    def _check_active(self, active: bool, message: str) -> None:
        self._check_configured()
        if self.update_active != active:
            raise _WorkerError(message)

    # -- endpoints ------------------------------------------------------------------

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.report_version or self.weight_version})

    async def _is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _is_sleeping(self, _: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _validation_error(
                [
                    {
                        "type": "literal_error",
                        "loc": ("query", "mode"),
                        "msg": "Input should be 'abort', 'wait' or 'keep'",
                    }
                ]
            )
        if mode == "abort":
            self.set_running(0)
        elif mode == "wait" and self.running_requests:
            await self._requests_done.wait()
        # clear_cache (deprecated, default true) is ignored in keep mode.
        if mode != "keep" and request.query.get("clear_cache", "true").lower() != "false":
            self.prefix_cache_entries = 0
        self.paused = True
        self.pause_mode = mode
        return web.json_response({"status": "paused"})

    async def _resume(self, _: web.Request) -> web.Response:
        if self.on_meta:
            self.healthy = False  # the next forward pass runs on meta tensors and dies
        self.paused = False
        self.pause_mode = None
        return web.json_response({"status": "resumed"})

    async def _init(self, request: web.Request) -> web.Response:
        body = await self._parse(request, InitBody)
        if isinstance(body, web.Response):
            return body
        try:
            self._check_configured()
            info = _construct(IPCWeightTransferInitInfo, body.init_info, "init_info")
        except _WorkerError as err:
            return _rpc_failure(err)
        self.packed = info.packed
        return web.json_response({"message": "Weight transfer initialized"})

    async def _start(self, _: web.Request) -> web.Response:
        try:
            self._check_active(False, ALREADY_ACTIVE)
        except _WorkerError as err:
            return _rpc_failure(err)
        self.update_active = True
        return web.json_response({"message": "Weight update started"})

    async def _update(self, request: web.Request) -> web.Response:
        body = await self._parse(request, UpdateBody)
        if isinstance(body, web.Response):
            return body
        try:
            self._check_active(True, NOT_STARTED)
            self._receive_all(body.update_info)
        except _WorkerError as err:
            # gpu_worker.update_weights ends the session when the engine raises.
            self.update_active = False
            self.on_meta = True
            return _rpc_failure(err)
        return web.json_response({"message": "Weights updated"})

    def _receive_all(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Every worker receives; the first one's tensors go into the model."""
        try:
            for rank, key in enumerate(self.device_keys):
                local = update_info[rank] if isinstance(update_info, list) else update_info
                weights = self._receive(local, key)
                if rank == 0:
                    for name, tensor in weights:
                        apply_to_model(self.model, name, tensor)
                        self.loaded.append(name)
        except (KeyError, ValueError, TypeError, AssertionError, IndexError) as err:
            raise _WorkerError(str(err)) from err

    def _receive(self, raw_info: dict[str, Any], key: str) -> list[tuple[str, torch.Tensor]]:
        """IPCWeightTransferEngine.receive_weights (packed) for the worker on `key`."""
        info = _construct(IPCWeightTransferUpdateInfo, raw_info, "update_info")
        if info.ipc_handles_pickled is not None:
            if info.ipc_handles is not None:
                raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
            if not self.allow_insecure_serialization:
                raise ValueError(INSECURE_REFUSED)
            info.ipc_handles = restricted_loads(base64.b64decode(info.ipc_handles_pickled))
        if info.ipc_handles is None:
            raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")
        count = len(info.names)
        if len(info.dtype_names) != count or len(info.shapes) != count:
            raise ValueError("`dtype_names` and `shapes` should be of the same size as `names`")
        if not self.packed:
            assert isinstance(info.ipc_handles, list)  # mirrors ipc_engine.py
            raise ValueError("the fake serves packed IPC transfers only")
        if info.tensor_sizes is None:
            raise ValueError("`tensor_sizes` is required when packed=True")
        assert isinstance(info.ipc_handles, dict)  # mirrors ipc_engine.py
        if key not in info.ipc_handles:
            raise ValueError(
                f"IPC handle not found for GPU UUID {key}. "
                f"Available UUIDs: {list(info.ipc_handles.keys())}"
            )
        args = list(info.ipc_handles[key])
        if key == "cpu":
            packed = reductions.rebuild_tensor(*args)  # type: ignore[no-untyped-call]
        else:
            args[6] = local_cuda_index(key)
            packed = reductions.rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
        packed = packed[: sum(info.tensor_sizes)]
        dtypes = [getattr(torch, name) for name in info.dtype_names]
        pieces = packed.split(info.tensor_sizes)
        return [
            (name, piece.contiguous().view(dtype).view(shape).clone())
            for name, shape, dtype, piece in zip(
                info.names, info.shapes, dtypes, pieces, strict=False
            )
        ]

    async def _finish(self, request: web.Request) -> web.Response:
        body = await self._parse(request, FinishBody, optional=True)
        if isinstance(body, web.Response):
            return body
        try:
            self._check_active(True, FINISH_WITHOUT_START)
        except _WorkerError as err:
            return _rpc_failure(err)
        self.update_active = False
        self.on_meta = False  # finalize_layerwise_reload restores what received nothing
        if body.weight_version is not None:
            self.weight_version = body.weight_version
        return web.json_response({"message": "Weight update finished"})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._parse(request, VersionBody)
        if isinstance(body, web.Response):
            return body
        self.weight_version = body.new_version
        return web.json_response({"success": True, "new_version": body.new_version})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        # Scheduler.reset_prefix_cache: running requests hold blocks unless preempted.
        if request.query.get("reset_running_requests", "false").lower() == "true":
            self.waiting_requests += self.running_requests
            self.set_running(0)
        success = self.running_requests == 0
        if success:
            self.prefix_cache_entries = 0
        return web.json_response({"success": success})

    async def _shutdown(self, _: web.Request) -> web.Response:
        if self.update_active:
            return _rpc_failure(
                _WorkerError("Cannot release a trainer connection during a weight update")
            )
        return web.json_response({"message": "Weight transfer shut down"})


def _construct(cls: type[_T], values: dict[str, Any], what: str) -> _T:
    """WeightTransferEngine.parse_*_info: the dataclass, or its TypeError as ValueError."""
    try:
        return cls(**values)
    except TypeError as err:
        raise _WorkerError(f"Invalid {what} for IPCWeightTransferEngine: {err}") from err


def _rpc_failure(err: Exception) -> web.Response:
    # vLLM with several worker processes (always on CPU; on GPU with TP > 1) wraps the
    # worker's message; the real CPU server's replies were recorded that way.
    message = RPC_FAILED + WORKER_FAILED.format(err)
    return web.json_response(
        {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}},
        status=500,
    )


def _validation_error(errors: list[dict[str, Any]]) -> web.Response:
    """vLLM's RequestValidationError handler: 400 with an ErrorResponse body."""
    count = len(errors)
    message = f"{count} validation error{'s' if count != 1 else ''}:\n"
    message += "".join(
        f"  {dict(err, loc='.'.join(str(p) for p in err['loc']))}\n" for err in errors
    )
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return web.json_response(
        {
            "error": {
                "message": message.rstrip(),
                "type": "Bad Request",
                "param": param,
                "code": 400,
            }
        },
        status=400,
    )
