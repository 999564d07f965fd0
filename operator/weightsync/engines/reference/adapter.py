"""`ReferenceEngineAdapter`: drives the reference engine's update API.

Slots are attached over HTTP; the attach reply names the engine's update channel (a
Unix socket, see `channel.py`), and begin, every bucket's load, finish and abort then go
over it. An engine without a channel, or one the agent cannot reach that way (another
network namespace), is driven over HTTP throughout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
import torch

from weightsync.engines.base import EngineAdapter, EngineError, EngineHealth, TensorSlice
from weightsync.engines.reference.channel import (
    AbortRequest,
    BeginRequest,
    FinishRequest,
    Reply,
    UpdateChannelClient,
    rows,
)
from weightsync.transfer.buffers import describe_slots
from weightsync.transfer.handoff import ProtocolError

log = logging.getLogger(__name__)


class ReferenceEngineAdapter(EngineAdapter):
    """One engine: an HTTP session for attach and health, the update channel per bucket."""

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_seconds: float = 60.0,
        use_channel: bool = True,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout_seconds = request_timeout_seconds
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_seconds)
        self._use_channel = use_channel
        self._session: aiohttp.ClientSession | None = None
        self._channel: UpdateChannelClient | None = None

    @property
    def channel_address(self) -> str | None:
        """The update channel in use, or None while the adapter uses HTTP."""
        return self._channel.address if self._channel is not None else None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _post(self, action: str, body: str) -> dict[str, Any]:
        try:
            async with self._client().post(
                f"{self._base_url}/v1/update/{action}",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as response:
                payload = await response.text()
                if response.status == 200:
                    return _json(payload)
                if response.status == 409:
                    error = _json(payload)
                    raise EngineError(
                        str(error.get("reason", "rejected")), str(error.get("message"))
                    )
                raise EngineError("http_error", f"{action}: HTTP {response.status}: {payload}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError("unreachable", f"{action}: {exc!r}") from exc

    async def _over_channel(self, what: str, call: Any) -> None:
        channel = self._channel
        if channel is None:
            raise EngineError("unreachable", f"{what}: no update channel")
        try:
            reply: Reply = await asyncio.wait_for(call(channel), self._timeout_seconds)
        except TimeoutError as exc:
            raise EngineError(
                "timeout", f"{what}: no reply within {self._timeout_seconds:g} s"
            ) from exc
        except (OSError, ProtocolError) as exc:
            raise EngineError("unreachable", f"{what}: {exc!r}") from exc
        if not reply.ok:
            raise EngineError(reply.reason or "rejected", reply.message)

    async def attach_buffers(self, slots: Sequence[torch.Tensor]) -> None:
        reply = await self._post("attach", describe_slots(slots).model_dump_json())
        address = reply.get("update_channel") if self._use_channel else None
        if self._channel is not None and self._channel.address != address:
            await self._channel.close()
            self._channel = None
        if isinstance(address, str) and address and self._channel is None:
            channel = UpdateChannelClient(address)
            try:
                await asyncio.wait_for(channel.connect(), self._timeout_seconds)
            except (OSError, TimeoutError) as exc:
                log.warning("update channel %s unreachable, using HTTP: %s", address, exc)
            else:
                self._channel = channel
                log.info("engine updates go over the update channel %s", address)

    async def begin_update(self, version: int) -> None:
        if self._channel is not None:
            await self._over_channel("begin", lambda c: c.call(BeginRequest(version=version)))
        else:
            await self._post("begin", _dumps({"version": version}))

    async def load_bucket(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        if self._channel is not None:
            await self._over_channel(f"load slot {slot}", lambda c: c.load(slot, tensors))
        else:
            await self._post("load", _dumps({"slot": slot, "tensors": rows(tensors)}))

    async def finish_update(self, version: int) -> None:
        if self._channel is not None:
            await self._over_channel("finish", lambda c: c.call(FinishRequest(version=version)))
        else:
            await self._post("finish", _dumps({"version": version}))

    async def abort_update(self, version: int, reason: str) -> None:
        if self._channel is not None:
            request = AbortRequest(version=version, reason=reason)
            await self._over_channel("abort", lambda c: c.call(request))
        else:
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
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
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
