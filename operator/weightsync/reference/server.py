"""The reference inference server: greedy generation over HTTP plus the update API.

Routes:
* `POST /generate`          {"input_ids": [[int]], "max_new_tokens": int}
                            -> {"output_ids": [[int]], "weight_version": int | null}
* `GET  /health`            -> {"healthy", "version", "torn", "detail", "incarnation"}
* `GET  /v1/weights/digest` -> {"version", "tensors": {name: sha256}}, and with
                            `--tp N` "workers": [{"device", "version", "tensors",
                            "loaded_bytes"}] (where workers differ, "tensors" says so)
* `POST /v1/update/attach`  `SlotHandles`            (once, or when the slots change)
                            -> {"ok", "version", "incarnation",
                                "update_channel": address | null,
                                "staging": "shared" | null}
* `POST /v1/update/begin`   {"version"}
* `POST /v1/update/load`    {"slot", "tensors": [[name, dtype, shape, offset, nbytes]]}
* `POST /v1/update/finish`  {"version"}              (atomic swap to the new version)
* `POST /v1/update/abort`   {"version", "reason"}
* `POST /v1/memory/release` {"tags": ["kv_cache", "weights"]} -> {"ok", "released", ...}
* `POST /v1/memory/resume`  {"tags": [...]}           (Colocated: between rounds; while
                            anything is released, generate answers 503, health's
                            detail says "sleeping: ..." and its `released` lists it)

Update errors answer 409 with {"reason", "message"}; the adapter turns them into
`EngineError`. The server listens on localhost by default: the update API is for the
agent sidecar in the same pod, not for clients. The same update calls are also served
on the update channel (`channel.py`, a Unix socket announced in the attach reply),
which is what the adapter uses per bucket; the HTTP routes stay for other clients.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weightsync.api.engines import MemoryTag
from weightsync.api.reasons import EngineErrorReason
from weightsync.engines.base import EngineError
from weightsync.reference.channel import UpdateChannelServer
from weightsync.reference.engine import ReferenceEngine
from weightsync.reference.model import PRESETS, ModelConfig, build_model, preset
from weightsync.reference.served import ServedEngine
from weightsync.reference.tensor_parallel import TensorParallelEngine, agreed
from weightsync.reference.tp_worker import WorkerSpec
from weightsync.transfer.buffers import SlotError, SlotHandles, torch_dtype
from weightsync.transfer.layout import TensorSlice

log = logging.getLogger(__name__)

ENGINE_KEY: web.AppKey[ServedEngine] = web.AppKey("engine")
CHANNEL_KEY: web.AppKey[str] = web.AppKey("update_channel", str)  # "" when there is none
EXECUTOR_KEY: web.AppKey[ThreadPoolExecutor] = web.AppKey("executor", ThreadPoolExecutor)


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GenerateRequest(_Body):
    input_ids: list[list[int]] = Field(min_length=1)
    max_new_tokens: int = Field(default=16, ge=1, le=4096)


class VersionRequest(_Body):
    version: int = Field(ge=0)


class AbortRequest(_Body):
    version: int = Field(ge=0)
    reason: str = ""


class MemoryRequest(_Body):
    tags: frozenset[MemoryTag] = Field(min_length=1)


class LoadRequest(_Body):
    slot: int = Field(ge=0)
    tensors: list[tuple[str, str, list[int], int, int]]

    def slices(self) -> list[TensorSlice]:
        return [TensorSlice(n, d, tuple(s), o, b) for n, d, s, o, b in self.tensors]


def _engine_error(exc: EngineError) -> web.Response:
    return web.json_response({"reason": exc.reason, "message": str(exc)}, status=409)


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise web.HTTPBadRequest(text=exc.json(), content_type="application/json") from exc


async def _in_thread(request: web.Request, fn: Callable[[], Any]) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[EXECUTOR_KEY], fn)


async def generate(request: web.Request) -> web.Response:
    body = _parse(GenerateRequest, await request.read())
    engine = request.app[ENGINE_KEY]
    try:
        outputs, version = await _in_thread(
            request, lambda: engine.generate(body.input_ids, body.max_new_tokens)
        )
    except EngineError as exc:
        if exc.reason == EngineErrorReason.SLEEPING:
            raise web.HTTPServiceUnavailable(text=str(exc)) from exc
        raise web.HTTPBadRequest(text=str(exc)) from exc
    return web.json_response({"output_ids": outputs, "weight_version": version})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    state = engine.health()
    return web.json_response(
        {
            "healthy": state.healthy,
            "version": state.version,
            "torn": state.torn,
            "detail": state.detail,
            "incarnation": state.incarnation,
            "released": sorted(state.released),  # memory released, not woken yet
            "staged_buckets": engine.staged_buckets,  # how far an open update got
            # What it holds in memory (with --tp, its workers together): weights,
            # arenas, KV cache.
            "resident_bytes": engine.resident_bytes,
        }
    )


async def digest(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not isinstance(engine, TensorParallelEngine):
        version, tensors = await _in_thread(request, engine.digests)
        return web.json_response({"version": version, "tensors": tensors})
    workers = await _in_thread(request, engine.worker_digests)
    version, tensors = agreed(workers)
    rows = [dataclasses.asdict(w) for w in workers]
    return web.json_response({"version": version, "tensors": tensors, "workers": rows})


async def memory(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = _parse(MemoryRequest, await request.read())
    action = request.match_info["action"]
    try:
        if action == "release":
            released = await _in_thread(request, lambda: engine.release(body.tags))
        elif action == "resume":
            await _in_thread(request, lambda: engine.resume(body.tags))
            released = frozenset()
        else:
            raise web.HTTPNotFound
    except EngineError as exc:
        return _engine_error(exc)
    return web.json_response(
        {"ok": True, "released": sorted(released), "incarnation": engine.incarnation}
    )


async def update(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    raw = await request.read()
    action = request.match_info["action"]
    call: Callable[[], None]
    if action == "attach":
        handles = _parse(SlotHandles, raw)
        call = lambda: engine.attach(handles)  # noqa: E731
    elif action == "begin":
        begin = _parse(VersionRequest, raw)
        call = lambda: engine.begin(begin.version)  # noqa: E731
    elif action == "load":
        load = _parse(LoadRequest, raw)
        call = lambda: engine.load(load.slot, load.slices())  # noqa: E731
    elif action == "finish":
        finish = _parse(VersionRequest, raw)
        call = lambda: engine.commit(finish.version)  # noqa: E731
    elif action == "abort":
        abort = _parse(AbortRequest, raw)
        log.warning("update to version %d aborted: %s", abort.version, abort.reason)
        call = lambda: engine.abort(abort.version)  # noqa: E731
    else:
        raise web.HTTPNotFound
    try:
        await _in_thread(request, call)
    except EngineError as exc:
        return _engine_error(exc)
    except SlotError as exc:  # slots this engine cannot open (none on its device)
        return _engine_error(EngineError("bad_slots", str(exc)))
    body: dict[str, Any] = {
        "ok": True,
        "version": engine.version,
        "incarnation": engine.incarnation,
    }
    if action == "attach":
        channel = request.app[CHANNEL_KEY] or None
        body["update_channel"] = channel
        # The agent may fill the staging arenas itself (`stage` on the channel).
        body["staging"] = "shared" if channel and engine.shares_arenas else None
    return web.json_response(body)


def make_app(engine: ServedEngine, *, update_channel: str = "") -> web.Application:
    """The HTTP app; `update_channel` is the address of a running `UpdateChannelServer`."""
    app = web.Application(client_max_size=64 << 20)
    app[ENGINE_KEY] = engine
    app[CHANNEL_KEY] = update_channel
    # One worker: updates and generation are ordered by the engine's own lock anyway,
    # and torch uses its own threads inside each call.
    app[EXECUTOR_KEY] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ref-engine")
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/weights/digest", digest)
    app.router.add_post("/v1/update/{action}", update)
    app.router.add_post("/v1/memory/{action}", memory)

    async def _shutdown(app: web.Application) -> None:
        app[EXECUTOR_KEY].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_shutdown)
    return app


def _engine(
    args: argparse.Namespace, config: ModelConfig, parser: argparse.ArgumentParser
) -> ServedEngine:
    """One engine in this process, or `--tp` workers in processes of their own."""
    seed = None if args.no_init else args.seed
    if args.tp == 1:
        model = build_model(config, seed, dtype=torch_dtype(args.dtype), device=args.device)
        return ReferenceEngine(
            model,
            shm_dir=None if args.shm_dir == "none" else args.shm_dir,
            load_delay_seconds=args.load_delay_seconds,
            kv_cache_bytes=args.kv_cache_bytes,
        )
    spec = WorkerSpec(
        args.preset, args.layers, seed, args.dtype, args.device, args.threads,
        args.load_delay_seconds,
    )  # fmt: skip
    try:
        engine = TensorParallelEngine(spec, args.tp)
    except EngineError as exc:
        parser.exit(2, f"weightsync reference engine: workers did not start: {exc}\n")
    log.info("serving with %d tensor-parallel workers on %s", args.tp, engine.devices)
    return engine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="weightsync reference inference engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument(
        "--layers", type=int, default=None, help="only the preset's first N layers (benchmarks)"
    )
    parser.add_argument("--seed", type=int, default=0, help="initial weights (version none)")
    parser.add_argument(
        "--no-init", action="store_true", help="leave weights uninitialised (large benchmarks)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel workers: one process per device from --device on, each "
        "loading from its own copy of the agent's slots",
    )
    parser.add_argument(
        "--load-delay-seconds",
        type=float,
        default=0.0,
        help="tests: each bucket load takes this much longer, so a test can act mid-round",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=0,
        help="the KV cache it reserves, released and resumed between Colocated rounds",
    )
    parser.add_argument(
        "--shm-dir",
        default="/dev/shm",  # noqa: S108 - POSIX shared memory, not a temp dir
        help="where a CPU engine keeps its staging arenas so the agent can fill them; "
        "'none' keeps them private",
    )
    parser.add_argument(
        "--update-socket",
        default=None,
        help="update channel address: @name (abstract) or a path; 'none' for HTTP only "
        "(default: @weightsync-reference-HOST-PORT)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    try:
        config = preset(args.preset, args.layers)
    except ValueError as exc:
        parser.error(str(exc))
    if not math.isfinite(args.load_delay_seconds) or args.load_delay_seconds < 0:
        parser.error("--load-delay-seconds must be a finite number >= 0")
    if args.tp < 1:
        parser.error("--tp must be at least 1")
    if args.kv_cache_bytes < 0 or (args.kv_cache_bytes and args.tp != 1):
        parser.error("--kv-cache-bytes must be >= 0, and is for one engine (--tp 1) only")
    engine = _engine(args, config, parser)
    address = args.update_socket or f"@weightsync-reference-{args.host}-{args.port}"
    channel: UpdateChannelServer | None = None
    if address != "none":
        channel = UpdateChannelServer(engine, address)
        try:
            channel.start()
        except OSError as exc:  # the adapter falls back to HTTP
            log.warning("no update channel on %s: %s", address, exc)
            channel = None
    app = make_app(engine, update_channel=channel.address if channel else "")
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    finally:
        if channel is not None:
            channel.close()
        engine.close()


if __name__ == "__main__":
    main()
