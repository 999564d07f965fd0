"""A round's engine calls, in order, beside the bucket pipeline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from weightsync.agent.failures import Stage
from weightsync.agent.rounds import RoundFailed
from weightsync.agent.trace import PhaseTrace
from weightsync.api.reasons import FailureReason
from weightsync.engines.base import EngineError


class EngineLane:
    """A round's engine calls, one at a time and in order, off the bucket pipeline's path.

    `submit` returns a task at once; its call runs after every earlier one, so the next
    bucket can be received (or filled) while the engine loads this one. The first
    failure is kept in `error` and later calls are skipped: the round keeps its
    collectives in step and fails at the vote. Tasks never raise `EngineError`.
    """

    def __init__(self, timeout_seconds: float, trace: PhaseTrace, deadline: float) -> None:
        self._timeout = timeout_seconds
        self._deadline = deadline  # the round's: no call outlives it
        self._trace = trace
        self._tasks: list[asyncio.Task[None]] = []
        self.error: RoundFailed | None = None

    def submit(
        self, what: str, phase: str, call: Callable[[], Awaitable[None]]
    ) -> asyncio.Task[None]:
        previous = self._tasks[-1] if self._tasks else None
        task = asyncio.create_task(self._run(previous, what, phase, call))
        self._tasks.append(task)  # a round submits a few dozen: kept until drained
        return task

    async def _run(
        self,
        previous: asyncio.Task[None] | None,
        what: str,
        phase: str,
        call: Callable[[], Awaitable[None]],
    ) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # in order; a cancelled one is not our failure
        if self.error is not None:
            return
        started = self._trace.now()
        budget = min(self._timeout, max(0.0, self._deadline - time.monotonic()))
        stage = Stage.COMMIT if phase == "engine_finish" else Stage.ENGINE_LOAD
        try:
            await asyncio.wait_for(call(), budget)
        except EngineError as exc:
            self.error = RoundFailed(f"engine_{exc.reason}", f"{what}: {exc}", stage)
        except TimeoutError:
            message = f"{what}: no answer in {budget:.1f} s"
            self.error = RoundFailed(FailureReason.ENGINE_TIMEOUT, message, stage)
        self._trace.add(phase, started)

    async def wait(self, task: asyncio.Task[None], phase: str = "engine_wait") -> None:
        """Return once `task`'s call is done (its slot may be reused); time the wait."""
        if task.done():
            task.result()
            return
        started = self._trace.now()
        await task
        self._trace.add(phase, started)

    async def drain(self) -> None:
        """Wait for every submitted call."""
        for task in self._tasks:
            await task

    async def cancel(self) -> None:
        """Stop calls not yet finished (a failed round); the adapter drops what it had open."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks.clear()
