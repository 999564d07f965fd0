"""Real aiohttp servers on free loopback ports, for tests that stand in for the API
server, an agent or an engine over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


async def start(app: web.Application, host: str = "127.0.0.1") -> tuple[web.AppRunner, int]:
    """Serve `app` on a free port of `host`; the runner (to clean up) and the port."""
    # In-flight handlers (a stalled reply in a timeout test) get a short grace at exit.
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    await web.TCPSite(runner, host, 0).start()
    return runner, runner.addresses[0][1]


@asynccontextmanager
async def serving(app: web.Application, host: str = "127.0.0.1") -> AsyncIterator[int]:
    """`start`, then clean up on leaving; yields the port."""
    runner, port = await start(app, host)
    try:
        yield port
    finally:
        await runner.cleanup()
