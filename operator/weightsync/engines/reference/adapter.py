"""`ReferenceEngineAdapter`: drives the reference engine's update API over HTTP."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp
import torch

from weightsync.engines.base import EngineAdapter, EngineError, EngineHealth, TensorSlice
from weightsync.transfer.buffers import describe_slots


class ReferenceEngineAdapter(EngineAdapter):
    """One HTTP session to one reference engine; only metadata crosses it per bucket."""

    def __init__(self, base_url: str, *, request_timeout_seconds: float = 60.0) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _post(self, action: str, body: str) -> None:
        try:
            async with self._client().post(
                f"{self._base_url}/v1/update/{action}",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as response:
                if response.status == 200:
                    return
                payload = await response.text()
                if response.status == 409:
                    error = _json(payload)
                    raise EngineError(
                        str(error.get("reason", "rejected")), str(error.get("message"))
                    )
                raise EngineError("http_error", f"{action}: HTTP {response.status}: {payload}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError("unreachable", f"{action}: {exc!r}") from exc

    async def attach_buffers(self, slots: Sequence[torch.Tensor]) -> None:
        await self._post("attach", describe_slots(slots).model_dump_json())

    async def begin_update(self, version: int) -> None:
        await self._post("begin", _dumps({"version": version}))

    async def load_bucket(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        rows = [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in tensors]
        await self._post("load", _dumps({"slot": slot, "tensors": rows}))

    async def finish_update(self, version: int) -> None:
        await self._post("finish", _dumps({"version": version}))

    async def abort_update(self, version: int, reason: str) -> None:
        await self._post("abort", _dumps({"version": version, "reason": reason}))

    async def health(self) -> EngineHealth:
        try:
            async with self._client().get(f"{self._base_url}/health") as response:
                if response.status != 200:
                    return EngineHealth(False, None, detail=f"HTTP {response.status}")
                body = await response.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return EngineHealth(False, None, detail=f"unreachable: {exc!r}")
        return EngineHealth(
            healthy=bool(body["healthy"]),
            version=body["version"],
            torn=bool(body.get("torn", False)),
            detail=str(body.get("detail", "")),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))


def _json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {"message": text}
    return value if isinstance(value, dict) else {"message": text}
