"""A small aiohttp client shared by the HTTP engine adapters (SGLang, vLLM).

Every request carries its own timeout; transport failures and error replies become
`EngineError`s whose `reason` is one of the short labels below (they end up as a metric
label, so the set stays small). The engine's own error text is kept in the message.

Every request opens a connection of its own (no keep-alive pool). uvicorn, which serves
both vLLM and SGLang, closes a keep-alive connection after answering 500 without saying
`Connection: close`, and after 5 s idle; the next request on the pooled connection then
failed with "Connection reset by peer" (seen against vLLM 0.32: the adapter's recovery
after a worker error ended in `unreachable`). A round sends a handful of requests plus
one per bucket, so a connect each costs nothing next to the load it asks for.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import SecretStr

from weightsync.api.reasons import EngineErrorReason
from weightsync.engines.base import EngineError

HTTP_SERVER_ERROR = 500


@dataclass(frozen=True, slots=True)
class Reply:
    """An engine's reply, read completely."""

    status: int
    text: str

    def json(self) -> Any:
        """The body parsed as JSON; `EngineError(bad_reply)` when it is not JSON."""
        try:
            return json.loads(self.text)
        except ValueError:
            raise EngineError(
                EngineErrorReason.BAD_REPLY, f"expected JSON, got {self.text[:200]!r}"
            ) from None

    def json_object(self) -> dict[str, Any]:
        body = self.json()
        if not isinstance(body, dict):
            raise EngineError(
                EngineErrorReason.BAD_REPLY, f"expected a JSON object, got {self.text[:200]!r}"
            )
        return body


def normalize_base_url(value: str) -> str:
    """An engine's base URL without a trailing slash; only http(s)."""
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be an http(s) URL, got {value!r}")
    return value.rstrip("/")


def engine_message(reply: Reply) -> str:
    """The human part of an error body, whichever of the engines' shapes it has.

    SGLang: {"success": false, "message": ...} or {"object": "error", "message": ...};
    vLLM: {"error": {"message": ...}} or {"error": "..."}; FastAPI: {"detail": ...}.
    """
    try:
        body = json.loads(reply.text)
    except ValueError:
        return reply.text.strip()[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:500]
        for key in ("message", "error", "detail"):
            if key in body:
                return str(body[key])[:500]
    return reply.text.strip()[:500]


def error_reason(status: int) -> str:
    return (
        EngineErrorReason.ENGINE_FAILED
        if status >= HTTP_SERVER_ERROR
        else EngineErrorReason.REJECTED
    )


class EngineHTTP:
    """One engine's HTTP endpoint: a lazily created session and per-request timeouts."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_seconds: float,
        api_key: SecretStr | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._connect_timeout = connect_timeout_seconds
        self._headers = {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # A session binds to the running loop, so it is made on first use, not in __init__.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(force_close=True)
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        timeout_seconds: float,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> Reply:
        """Send one request and read the whole reply; raise `EngineError` on transport failure."""
        timeout = aiohttp.ClientTimeout(
            total=timeout_seconds, sock_connect=min(self._connect_timeout, timeout_seconds)
        )
        what = f"{method} {path}"
        try:
            async with self._client().request(
                method,
                f"{self.base_url}{path}",
                json=json_body,
                params=params,
                timeout=timeout,
            ) as response:
                text = await response.text()
                return Reply(status=response.status, text=text)
        except TimeoutError:
            raise EngineError(
                EngineErrorReason.TIMEOUT, f"{what}: no reply within {timeout_seconds:g} s"
            ) from None
        except aiohttp.ClientError as err:
            raise EngineError(
                EngineErrorReason.UNREACHABLE, f"{what}: {type(err).__name__}: {err}"
            ) from err

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
            # aiohttp closes the transport on the next loop iteration.
            await asyncio.sleep(0)
        self._session = None
