"""Recorded exchanges (recordings/*.json): matching, a replay server, and drivers.

A recording holds scenarios; each is a list of exchanges, a request and the engine's
reply, in order. Strings of the form "<...>" are placeholders: "<str>" any string,
"<base64>" a base64 string, "<floats:N>" a list of N numbers, "<any>" any value. A
request without "json" has no body.
An exchange with "by" was sent by someone other than the adapter (an earlier agent,
another client): a replay against the adapter skips it, a replay against a fake sends it.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from tests.unit.engines.support import pack
from weightsync.engines._rounds import RoundAdapter
from weightsync.engines.base import EngineError
from weightsync.transfer.layout import TensorSlice

RECORDINGS = Path(__file__).parent / "recordings"


def load_recording(name: str) -> dict[str, Any]:
    recording: dict[str, Any] = json.loads((RECORDINGS / name).read_text())
    return recording


def _placeholder_mismatch(kind: str, actual: Any, where: str) -> str | None:
    if kind == "any":
        return None
    if kind.startswith("floats:"):
        count = int(kind.removeprefix("floats:"))
        if not isinstance(actual, list) or len(actual) != count:
            return f"{where}: expected a list of {count} numbers, got {str(actual)[:80]}"
        bad = [item for item in actual if not isinstance(item, int | float)]
        return f"{where}: not numbers: {bad[:3]}" if bad else None
    if not isinstance(actual, str):
        return f"{where}: expected a string, got {actual!r}"
    if kind == "base64":
        try:
            base64.b64decode(actual, validate=True)
        except (binascii.Error, ValueError):
            return f"{where}: not base64: {actual[:40]!r}"
    return None


def mismatch(expected: Any, actual: Any, where: str = "$") -> str | None:
    """Why `actual` does not match `expected` (with placeholders), or None if it does."""
    if isinstance(expected, str) and expected.startswith("<") and expected.endswith(">"):
        return _placeholder_mismatch(expected[1:-1], actual, where)
    if isinstance(expected, dict) and isinstance(actual, dict):
        if expected.keys() != actual.keys():
            return f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        pairs = [(value, actual[key], f"{where}.{key}") for key, value in expected.items()]
    elif isinstance(expected, list) and isinstance(actual, list):
        if len(actual) != len(expected):
            return f"{where}: expected {len(expected)} items, got {len(actual)}"
        pairs = [
            (want, got, f"{where}[{i}]")
            for i, (want, got) in enumerate(zip(expected, actual, strict=True))
        ]
    elif type(expected) is not type(actual) or expected != actual:
        return f"{where}: {actual!r} != {expected!r}"
    else:
        return None
    return next((found for want, got, at in pairs if (found := mismatch(want, got, at))), None)


def request_mismatch(
    expected: dict[str, Any], method: str, path: str, query: dict[str, str], body: Any
) -> str | None:
    if (method, path) != (expected["method"], expected["path"]):
        return f"got {method} {path}, recording has {expected['method']} {expected['path']}"
    if query != expected.get("query", {}):
        return f"{path}: query {query} != {expected.get('query', {})}"
    if "json" not in expected:
        return None if body is None else f"{path}: unexpected body {body!r}"
    return mismatch(expected["json"], body, f"{path} body")


def response_mismatch(expected: dict[str, Any], status: int, text: str) -> str | None:
    if status != expected["status"]:
        return f"status {status} != {expected['status']}: {text[:300]}"
    if "json" in expected:
        try:
            body = json.loads(text)
        except ValueError:
            return f"not JSON: {text[:300]!r}"
        return mismatch(expected["json"], body, "response")
    if "text" in expected and text != expected["text"]:
        return f"text {text!r} != {expected['text']!r}"
    return None


@dataclass
class ReplayServer:
    """Answers the adapter with a scenario's recorded replies, checking each request."""

    exchanges: list[dict[str, Any]]
    position: int = 0
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.exchanges = [item for item in self.exchanges if "by" not in item]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        return app

    async def _answer(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        if self.position >= len(self.exchanges):
            self.problems.append(f"unexpected extra request {request.method} {request.path}")
            return web.Response(status=599)
        exchange = self.exchanges[self.position]
        self.position += 1
        problem = request_mismatch(
            exchange["request"], request.method, request.path, dict(request.query), body
        )
        if problem:
            self.problems.append(f"exchange {self.position}: {problem}")
            return web.Response(status=599)
        response = exchange["response"]
        if "json" in response:
            return web.Response(
                status=response["status"],
                text=json.dumps(_fill(response["json"])),
                content_type="application/json",
            )
        return web.Response(status=response["status"], text=response.get("text", ""))

    def check_done(self) -> None:
        assert not self.problems, self.problems
        assert self.position == len(self.exchanges), (
            f"adapter sent {self.position} of {len(self.exchanges)} recorded requests"
        )


def _fill(value: Any) -> Any:
    """A concrete reply for a recorded one: placeholders become plausible values."""
    if isinstance(value, str) and value.startswith("<floats:") and value.endswith(">"):
        return [0.0] * int(value[len("<floats:") : -1])
    if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
        return {"<any>": None}.get(value, "fake/llama")
    if isinstance(value, dict):
        return {key: _fill(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_fill(item) for item in value]
    return value


def bucket_tensors(spec: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors a recording's bucket names, with deterministic contents."""
    named = []
    for index, item in enumerate(spec):
        dtype = getattr(torch, item["dtype"])
        numel = 1
        for dim in item["shape"]:
            numel *= dim
        values = torch.arange(numel, dtype=torch.float32) + 0.25 + index
        named.append((item["name"], values.to(dtype).reshape(item["shape"])))
    return named


def pack_bucket(slot: torch.Tensor, spec: list[dict[str, Any]]) -> list[TensorSlice]:
    return pack(slot, bucket_tensors(spec))


Driver = Callable[[RoundAdapter, list[TensorSlice]], Awaitable[None]]


async def drive_round(adapter: RoundAdapter, bucket: list[TensorSlice]) -> None:
    await adapter.begin_update(1)
    await adapter.load_bucket(0, bucket)
    await adapter.finish_update(1)


async def drive_begin_then_abort(adapter: RoundAdapter, _: list[TensorSlice]) -> None:
    await adapter.begin_update(1)
    await adapter.abort_update(1, "replay")


async def drive_load_refused(adapter: RoundAdapter, bucket: list[TensorSlice]) -> None:
    await adapter.begin_update(1)
    with pytest.raises(EngineError) as caught:
        await adapter.load_bucket(0, bucket)
    assert caught.value.reason in ("rejected", "engine_failed")
    await adapter.abort_update(1, "replay")


async def drive_round_version_mismatch(adapter: RoundAdapter, bucket: list[TensorSlice]) -> None:
    await adapter.begin_update(1)
    await adapter.load_bucket(0, bucket)
    with pytest.raises(EngineError) as caught:
        await adapter.finish_update(1)
    assert caught.value.reason == "version_mismatch"


async def drive_health(adapter: RoundAdapter, _: list[TensorSlice]) -> None:
    health = await adapter.health()
    assert health.healthy
    assert health.version == 3
    assert not health.torn


DRIVERS: dict[str, Driver] = {
    "round": drive_round,
    "begin_then_abort": drive_begin_then_abort,
    "load_refused": drive_load_refused,
    "round_version_mismatch": drive_round_version_mismatch,
    "health": drive_health,
}
