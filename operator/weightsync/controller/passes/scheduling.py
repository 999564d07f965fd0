"""One reconcile pass at a time per WeightSync, and every caller gets a pass's result.

kopf calls a handler per event, and pod events come in bursts: passes of one WeightSync
must not overlap (they act on the same agents and status), and a burst should cost one
or two passes, not one per event. A caller that arrives while a pass runs waits for the
next pass, which starts after its request and serves everyone who arrived meanwhile;
each gets that pass's result (or exception), so a handler never mistakes a coalesced
request for a success. Retries are kopf's (the handler raises on the result).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from weightsync.controller.cluster.kube import api_unavailable
from weightsync.controller.runtime.tasks import Tasks
from weightsync.controller.runtime.timing import PASS_TIMEOUT_SECONDS

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


def log_pass_failure(what: str, error: BaseException) -> None:
    """A pass that failed outside kopf's retries (a timer, a follow-up): one line when the
    API server is away (the next pass retries), the traceback for anything else."""
    if api_unavailable(error):
        log.warning("%s: the API server is unavailable (%s); the next pass retries", what, error)
    elif isinstance(error, TimeoutError):  # `PASS_TIMEOUT_SECONDS`
        log.warning("%s: stuck, cancelled; the next pass retries", what)
    else:
        log.error("%s failed", what, exc_info=error)


@dataclass
class _Lane(Generic[R]):
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    requested: int = 0  # requests so far
    served: int = 0  # requests the last finished pass covers
    result: R | None = None
    queued: asyncio.Task[None] | None = None  # a requested pass that has not started yet


class PassScheduler(Generic[K, R]):
    def __init__(
        self,
        run_pass: Callable[[K], Awaitable[R]],
        request_delay: float = 0.0,
        pass_timeout: float = PASS_TIMEOUT_SECONDS,
        tasks: Tasks | None = None,
    ) -> None:
        self._run_pass = run_pass
        self._tasks = tasks or Tasks()
        self._request_delay = request_delay
        self._pass_timeout = pass_timeout
        self._lanes: dict[K, _Lane[R]] = {}

    def request(self, key: K, failed: Callable[[K, Exception], None]) -> None:
        """A pass for `key` that starts after this call, without waiting for it; its
        failure goes to `failed`."""
        lane = self._lanes.setdefault(key, _Lane())
        if lane.queued is not None:
            return  # a pass that has not started yet covers this request too

        async def follow() -> None:
            await asyncio.sleep(self._request_delay)  # what else the burst brings
            try:
                await self.run(key)
            except Exception as error:
                failed(key, error)

        lane.queued = self._tasks.spawn(f"pass {key}", follow())

    async def run(self, key: K) -> R:
        """A pass for `key` that started after this call, or its result."""
        lane = self._lanes.setdefault(key, _Lane())
        lane.requested += 1
        ticket = lane.requested
        async with lane.lock:
            if lane.queued is asyncio.current_task():
                lane.queued = None  # from here on, a request needs another pass
            if lane.served >= ticket and lane.result is not None:
                return lane.result  # a pass that started after our request has finished
            covers = lane.requested
            # An exception (a stuck pass's TimeoutError too) reaches this caller only.
            async with asyncio.timeout(self._pass_timeout):  # runs the pass in this task
                result = await self._run_pass(key)
            lane.served, lane.result = covers, result
            return result

    def forget(self, key: K) -> None:
        """Drop `key`'s bookkeeping (its object is gone); a later call starts afresh."""
        lane = self._lanes.get(key)
        if lane is not None and not lane.lock.locked():
            del self._lanes[key]
