"""The engine container's readiness, answered by its agent (`GET ENGINE_READY_PATH` on
the control port, no token: the kubelet sends none). Ready: the engine is healthy and
serves what this agent loaded into this very process, or nothing was loaded yet
(`EngineWatch.readiness`), and the check the webhook replaced passes (`EngineProbe`).
The body says why, for `kubectl describe pod`."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from weightsync.agent.engine_watch import EngineWatch
from weightsync.api.engine_probe import EngineProbe


async def engine_ready(
    watch: EngineWatch | None, probe: EngineProbe | None, pod_ip: str
) -> tuple[bool, str]:
    """`pod_ip`: where the repeated check goes unless it names a host."""
    if watch is None:  # not a sink: nothing of an engine to answer for
        return False, "this agent watches no engine"
    ready, why = watch.readiness()
    if not ready or probe is None:
        return ready, why
    failure = await run_probe(probe, pod_ip)
    if failure is not None:
        return False, f"the engine's own readiness check failed: {failure}"
    return True, why


async def run_probe(probe: EngineProbe, pod_ip: str) -> str | None:
    """None when `probe` passes, else what failed."""
    host = probe.host or pod_ip
    try:
        if probe.kind == "tcp":
            return await _connect(probe, host)
        return await _get(probe, host)
    except (TimeoutError, OSError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _connect(probe: EngineProbe, host: str) -> str | None:
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(host, probe.port), probe.timeout_seconds
    )
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def _get(probe: EngineProbe, host: str) -> str | None:
    url = f"{probe.scheme.lower()}://{host}:{probe.port}{probe.path}"
    timeout = aiohttp.ClientTimeout(total=probe.timeout_seconds)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(url, headers=probe.headers, ssl=False, allow_redirects=False) as response,
    ):
        if 200 <= response.status < 400:
            return None
        return f"GET {probe.path} answered {response.status}"
