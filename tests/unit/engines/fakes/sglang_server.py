"""A fake SGLang 0.5.23 HTTP server: the weight-update endpoints, strictly.

Request bodies are validated by pydantic models with the fields, types and defaults of
SGLang's request structs (srt/managers/io_struct.py, BaseReq's `rid` and
`http_worker_ipc` included). A body that fails validation gets SGLang's reply: 400 with
`ErrorResponse` {"object": "error", "message", "type": "Bad Request", "param", "code"}.
SGLang itself ignores unknown fields (its msgspec schema uses extra="ignore"); this fake
rejects them the same way by default, because a misspelt field that SGLang silently drops
is exactly the bug a contract test must catch (`strict_unknown_fields=False` ignores them).

`update_weights_from_tensor` is served for real: each TP rank's payload is base64-decoded,
unpickled through an allow-list (SGLang's SafeUnpickler semantics), the flattened tensor is
rebuilt from its IPC/shared-memory handle and sliced by the metadata as SGLang's
`FlattenedTensorBucket.reconstruct_tensors` does, and copied into `model`. A name the model
lacks is skipped and the reply still says success, as the real 0.5.23 server does (seen
on its CPU build: the loader logs the name and goes on). Where SGLang's scheduler would
raise (a shape that does not fit, a blocked global, a missing rank's payload) the
scheduler process dies; the fake drops the connection and stays dead.
`/get_weights_by_name` answers as SGLang's does: the first `truncate_size` rows as
float lists, or 400 "Get parameter by name failed" for a name the model lacks.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from tests.unit.engines.fakes.common import (
    NOT_JSON,
    FakeControls,
    apply_to_model,
    digests_route,
    drop_connection,
    logging_middleware,
    read_json_body,
    restricted_loads,
)

_M = TypeVar("_M", bound=BaseModel)

SESSION_REQUIRED = (
    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
)
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)
CACHE_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class _BaseReq(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    http_worker_ipc: str | None = None


class PauseGenerationReqInput(_BaseReq):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_BaseReq):
    torch_empty_cache: bool = True


class BeginWeightUpdateReqInput(_BaseReq):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(_BaseReq):
    pass


class UpdateWeightsFromTensorReqInput(_BaseReq):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class UpdateWeightVersionReqInput(_BaseReq):
    new_version: str
    abort_all_requests: bool = True


class GetWeightsByNameReqInput(_BaseReq):
    name: str
    truncate_size: int = 100


class _SchedulerCrashError(Exception):
    """What would kill SGLang's scheduler process."""


@dataclass
class FakeSGLang:
    model: dict[str, torch.Tensor]
    tp_size: int = 1
    weight_version: str = "default"
    strict_unknown_fields: bool = True
    paused: bool = False
    pause_mode: str | None = None
    session_open: bool = False
    running_requests: int = 0  # in the running batch
    waiting_requests: int = 0  # in the waiting queue
    report_version: str | None = None  # /model_info says this instead (version mismatch)
    healthy: bool = True
    paused_health_seconds: float = 0.2  # SGLang's /health waits up to 20 s, then 503
    loaded: list[str] = field(default_factory=list)  # parameter names, in load order
    skipped: list[str] = field(default_factory=list)  # names the model lacks, dropped
    crash_reason: str = ""
    api_key: str | None = None  # --api-key: every endpoint wants "Authorization: Bearer <key>"
    _requests_done: asyncio.Event = field(default_factory=asyncio.Event)
    controls: FakeControls = field(default_factory=FakeControls)

    @property
    def in_session(self) -> bool:
        return self.session_open

    def app(self) -> web.Application:
        app = web.Application(middlewares=[logging_middleware(self.controls), self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/begin_weight_update", self._begin)
        app.router.add_post("/end_weight_update", self._end)
        app.router.add_post("/update_weights_from_tensor", self._update_from_tensor)
        app.router.add_route("*", "/flush_cache", self._flush_cache)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_route("*", "/get_weights_by_name", self._get_weights_by_name)
        app.router.add_get("/_fake/digests", digests_route(self.model))
        return app

    # -- helpers --------------------------------------------------------------------

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # srt/utils/auth.py: a missing or wrong key is 401 {"error": "Unauthorized"}.
        if self.api_key is not None and request.headers.get("Authorization") != (
            f"Bearer {self.api_key}"
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _parse(self, request: web.Request, model: type[_M]) -> _M | web.Response:
        present, body = await read_json_body(request)
        if not present:
            return _validation_error(
                [{"type": "missing", "loc": ["body"], "msg": "Field required"}]
            )
        if body is NOT_JSON:
            return _validation_error(
                [{"type": "json_invalid", "loc": ["body"], "msg": "JSON decode error"}]
            )
        if isinstance(body, dict) and not self.strict_unknown_fields:
            body = {key: value for key, value in body.items() if key in model.model_fields}
        try:
            return model.model_validate(body)
        except ValidationError as err:
            errors = [
                {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
                for e in err.errors(include_url=False)
            ]
            return _validation_error(errors)

    def _flush(self) -> bool:
        # Scheduler.flush_cache: idle, ignoring the waiting queue while the engine is paused.
        return self.running_requests == 0 and (
            self.waiting_requests == 0 or (self.paused and self.pause_mode != "abort")
        )

    def set_running(self, count: int) -> None:
        """Requests in the running batch (a test's stand-in for traffic)."""
        self.running_requests = count
        if count:
            self._requests_done.clear()
        else:
            self._requests_done.set()

    def _abort_all(self) -> None:
        self.set_running(0)
        self.waiting_requests = 0

    # -- endpoints ------------------------------------------------------------------

    async def _health(self, _: web.Request) -> web.Response:
        if self.paused:
            # The probe's one-token generation waits behind the pause until it times out.
            await asyncio.sleep(self.paused_health_seconds)
            return web.Response(status=503)
        return web.Response(status=200 if self.healthy else 503)

    async def _model_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "fake/llama",
                "served_model_name": "fake/llama",
                "tokenizer_path": "fake/llama",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.report_version or self.weight_version,
                "load_format": "dummy",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "embedding": {"enabled": False},  # 0.5.23's embedding-serving summary
            }
        )

    async def _pause(self, request: web.Request) -> web.Response:
        obj = await self._parse(request, PauseGenerationReqInput)
        if isinstance(obj, web.Response):
            return obj
        self.paused = True
        self.pause_mode = obj.mode
        if obj.mode == "abort":
            self._abort_all()
        elif obj.mode == "retract":
            self.waiting_requests += self.running_requests
            self.set_running(0)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        obj = await self._parse(request, ContinueGenerationReqInput)
        if isinstance(obj, web.Response):
            return obj
        self.paused = False
        self.pause_mode = None
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _begin(self, request: web.Request) -> web.Response:
        obj = await self._parse(request, BeginWeightUpdateReqInput)
        if isinstance(obj, web.Response):
            return obj
        if self.session_open:
            return _result(False, SESSION_ALREADY_OPEN)
        self.session_open = True
        return _result(True, "Success")

    async def _end(self, request: web.Request) -> web.Response:
        obj = await self._parse(request, EndWeightUpdateReqInput)
        if isinstance(obj, web.Response):
            return obj
        if not self.session_open:
            return _result(False, NO_SESSION_OPEN)
        self.session_open = False
        return _result(True, "Success")

    async def _update_from_tensor(self, request: web.Request) -> web.StreamResponse:
        obj = await self._parse(request, UpdateWeightsFromTensorReqInput)
        if isinstance(obj, web.Response):
            return obj
        if obj.abort_all_requests:
            self._abort_all()
        try:
            # TokenizerManager normalizes the payloads before anything reaches a rank.
            raw = [base64.b64decode(item, validate=True) for item in obj.serialized_named_tensors]
        except binascii.Error:
            return web.Response(status=500, text="Internal Server Error")
        if not self.paused and self.running_requests:
            # Unpaused, the update takes the model-update writer lock: in-flight requests finish.
            await self._requests_done.wait()
        if not self.session_open:
            return _result(False, SESSION_REQUIRED)
        if obj.load_format != "flattened_bucket":
            return _result(False, f"fake SGLang serves flattened_bucket only: {obj.load_format}")
        try:
            self._load(raw)
        except (_SchedulerCrashError, KeyError, ValueError) as err:
            self.crash_reason = repr(err)
            self.controls.crashed = True
            drop_connection(request)
        message = "Success"
        if obj.flush_cache and not self._flush():
            return _result(False, FLUSH_REFUSED)
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return _result(True, message)

    def _load(self, raw: list[bytes]) -> None:
        per_rank = [self._rebuild_rank(raw, rank) for rank in range(self.tp_size)]
        for named in per_rank[1:]:
            for (name, tensor), (_, first) in zip(named, per_rank[0], strict=True):
                if not torch.equal(tensor.cpu(), first.cpu()):
                    raise _SchedulerCrashError(f"TP ranks read different bytes for {name}")
        for name, tensor in per_rank[0]:
            if name not in self.model:
                self.skipped.append(name)  # SGLang logs it and answers success
                continue
            apply_to_model(self.model, name, tensor)
            self.loaded.append(name)

    def _rebuild_rank(self, raw: list[bytes], rank: int) -> list[tuple[str, torch.Tensor]]:
        """TpModelWorker.deserialize_own_rank + _update_weights_from_flattened_bucket."""
        if rank >= len(raw):
            raise _SchedulerCrashError(f"IndexError: no payload for TP rank {rank}")
        try:
            bucket = restricted_loads(raw[rank])
            flattened = bucket["flattened_tensor"]
            return [
                (
                    meta.name,
                    flattened[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape),
                )
                for meta in bucket["metadata"]
            ]
        except Exception as err:
            raise _SchedulerCrashError(repr(err)) from err

    async def _flush_cache(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "POST"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
        if self._flush():
            return web.Response(status=200, text=CACHE_FLUSHED)
        return web.Response(status=400, text="Flush cache failed.\n")

    async def _get_weights_by_name(self, request: web.Request) -> web.Response:
        obj = await self._parse(request, GetWeightsByNameReqInput)
        if isinstance(obj, web.Response):
            return obj
        tensor = self.model.get(obj.name)
        if tensor is None:
            return web.json_response(
                {"error": {"message": "Get parameter by name failed"}}, status=400
            )
        return web.json_response(tensor.float().tolist()[: obj.truncate_size])

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        obj = await self._parse(request, UpdateWeightVersionReqInput)
        if isinstance(obj, web.Response):
            return obj
        if obj.abort_all_requests:
            self._abort_all()
        self.weight_version = obj.new_version
        return web.json_response(
            {
                "success": True,
                "message": f"Weight version updated to {obj.new_version}",
                "new_version": obj.new_version,
            }
        )


def _result(success: bool, message: str) -> web.Response:
    return web.json_response(
        {"success": success, "message": message}, status=200 if success else 400
    )


def _validation_error(errors: list[dict[str, Any]]) -> web.Response:
    """SGLang's RequestValidationError handler: 400 with an ErrorResponse body."""
    count = len(errors)
    message = f"{count} validation error{'s' if count != 1 else ''}: {errors}"
    return web.json_response(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
        status=400,
    )
