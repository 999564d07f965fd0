"""What both fake engines share: a restricted unpickler, a server runner, request logs.

The unpickler admits the globals a weight payload needs, each of which SGLang 0.5.23's
`SafeUnpickler.ALLOWED_GLOBALS` (srt/utils/common.py) also admits, and fails the same way
on anything else. vLLM unpickles `ipc_handles_pickled` with plain `pickle.loads`; its fake
uses this stricter loader too, so a payload that passes here passes both engines.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import pickle
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from aiohttp import web
from torch.multiprocessing import reductions

from tests.support.serving import serving

_TORCH_DTYPE_NAMES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}

# (module, name) pairs a weightsync payload may use; all are in SGLang's allow-list.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("builtins", "dict"),
        ("builtins", "list"),
        ("builtins", "tuple"),
        ("copyreg", "__newobj__"),
        ("types", "SimpleNamespace"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        *(("torch", name) for name in _TORCH_DTYPE_NAMES),
    }
)


def rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor` with args[6] mapped from a GPU UUID to a local index.

    SGLang patches torch's reductions the same way before it deserializes a payload
    (`monkey_patch_torch_reductions` in srt/utils/patch_torch.py).
    """
    device = args[6]
    if isinstance(device, str):
        args = (*args[:6], local_cuda_index(device), *args[7:])
    return reductions.rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call,no-any-return]


def local_cuda_index(device_uuid: str) -> int:
    """This process's index of the GPU with `device_uuid`."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return index
    raise RuntimeError(f"Invalid device_uuid={device_uuid}")


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise RuntimeError(
                f"Blocked unsafe global ({module}.{name}) during pickle deserialization"
            )
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return rebuild_cuda_tensor_by_uuid
        return super().find_class(module, name)


def restricted_loads(data: bytes) -> Any:
    return RestrictedUnpickler(io.BytesIO(data)).load()


@dataclass
class LoggedRequest:
    method: str
    path: str
    query: dict[str, str]
    body: Any  # parsed JSON, or None


@dataclass
class FakeControls:
    """Knobs a test turns on a fake engine."""

    delays: dict[str, float] = field(default_factory=dict)  # path -> seconds before replying
    crashed: bool = False  # every request's connection is dropped, as when the process died
    requests: list[LoggedRequest] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [request.path for request in self.requests]


async def read_json_body(request: web.Request) -> tuple[bool, Any]:
    """(present, parsed) for the request body; (True, _NotJson) when it is not JSON."""
    raw = await request.read()
    if not raw:
        return False, None
    try:
        return True, json.loads(raw)
    except ValueError:
        return True, NOT_JSON


NOT_JSON = object()


def logging_middleware(controls: FakeControls) -> Any:
    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        present, body = await read_json_body(request)
        controls.requests.append(
            LoggedRequest(
                request.method,
                request.path,
                dict(request.query),
                body if present and body is not NOT_JSON else None,
            )
        )
        if controls.crashed:
            drop_connection(request)
        delay = controls.delays.get(request.path, 0.0)
        if delay:
            await asyncio.sleep(delay)
        response: web.StreamResponse = await handler(request)
        if controls.crashed:
            drop_connection(request)
        return response

    return middleware


def drop_connection(request: web.Request) -> NoReturn:
    """Close the connection without a reply, as a killed server would."""
    if request.transport is not None:
        request.transport.abort()
    raise ConnectionResetError("fake engine crashed")


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """Run `app` on a free loopback port; yield its base URL."""
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}"


def apply_to_model(model: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    """Copy `tensor` into the model's parameter `name`, as a loader's copy_ would.

    A name the model lacks raises KeyError and a shape or dtype that differs raises
    ValueError, as the engines' `load_weights` do (their messages differ by model).
    """
    target = model[name]
    if target.shape != tensor.shape or target.dtype != tensor.dtype:
        raise ValueError(
            f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, "
            f"model has {tuple(target.shape)} {target.dtype}"
        )
    target.copy_(tensor)


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (without numpy, which the CI environment lacks)."""
    raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(bytes(raw.tolist())).hexdigest()


def digests_route(model: dict[str, torch.Tensor]) -> Callable[[web.Request], Any]:
    """GET /_fake/digests: the model's parameters by sha256, for a test in another process."""

    async def handler(_: web.Request) -> web.Response:
        return web.json_response({name: digest(tensor) for name, tensor in model.items()})

    return handler
