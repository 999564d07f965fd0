"""PassScheduler: one pass at a time per key; every caller gets the result of a pass
that started after its call, however many callers one pass serves."""

from __future__ import annotations

import asyncio

import pytest

from weightsync.controller.passes.scheduling import PassScheduler


class Passes:
    """A pass that records when it ran and what the world looked like when it started."""

    def __init__(self) -> None:
        self.world = 0  # bumped by the test: what a pass reads
        self.started: list[int] = []
        self.release = asyncio.Event()
        self.fail_next = False

    async def __call__(self, key: str) -> tuple[str, int]:
        seen = self.world
        self.started.append(seen)
        await self.release.wait()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("pass failed")
        return key, seen


def test_a_burst_during_a_pass_costs_one_more_pass_and_each_caller_sees_its_change() -> None:
    async def scenario() -> None:
        passes = Passes()
        scheduler: PassScheduler[str, tuple[str, int]] = PassScheduler(passes)
        first = asyncio.create_task(scheduler.run("a"))
        await asyncio.sleep(0)
        passes.world = 1  # three events arrive while the first pass runs
        burst = [asyncio.create_task(scheduler.run("a")) for _ in range(3)]
        await asyncio.sleep(0)
        passes.release.set()
        assert await first == ("a", 0)
        # Not the first pass's result: it started before their change.
        assert await asyncio.gather(*burst) == [("a", 1)] * 3
        assert passes.started == [0, 1]

    asyncio.run(scenario())


def test_keys_do_not_wait_for_each_other() -> None:
    async def scenario() -> None:
        passes = Passes()
        scheduler: PassScheduler[str, tuple[str, int]] = PassScheduler(passes)
        a = asyncio.create_task(scheduler.run("a"))
        b = asyncio.create_task(scheduler.run("b"))
        await asyncio.sleep(0)
        assert passes.started == [0, 0]  # both running at once
        passes.release.set()
        assert await asyncio.gather(a, b) == [("a", 0), ("b", 0)]

    asyncio.run(scenario())


def test_a_failed_pass_fails_its_caller_and_the_waiters_get_a_pass_of_their_own() -> None:
    async def scenario() -> None:
        passes = Passes()
        scheduler: PassScheduler[str, tuple[str, int]] = PassScheduler(passes)
        passes.fail_next = True
        first = asyncio.create_task(scheduler.run("a"))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(scheduler.run("a"))
        await asyncio.sleep(0)
        passes.release.set()
        with pytest.raises(RuntimeError, match="pass failed"):
            await first
        assert await waiter == ("a", 0)
        assert len(passes.started) == 2

    asyncio.run(scenario())


def test_requests_return_at_once_and_one_queued_pass_stands_for_all_of_them() -> None:
    async def scenario() -> None:
        passes = Passes()
        failures: list[str] = []
        scheduler: PassScheduler[str, tuple[str, int]] = PassScheduler(passes)
        running = asyncio.create_task(scheduler.run("a"))
        await asyncio.sleep(0)
        passes.world = 1  # a thousand pod events while that pass runs
        for _ in range(1000):
            scheduler.request("a", lambda key, error: failures.append(key))
        passes.release.set()
        await running
        for _ in range(10):
            await asyncio.sleep(0)
        assert passes.started == [0, 1]  # one more pass, and it saw the change
        passes.fail_next = True
        scheduler.request("a", lambda key, error: failures.append(key))
        for _ in range(10):
            await asyncio.sleep(0)
        assert failures == ["a"]

    asyncio.run(scenario())


def test_a_stuck_pass_is_cancelled_and_the_next_one_runs() -> None:
    # A pass that never returns (a request on a connection an API-server restart left
    # dangling) must not hold every later pass of its object behind it.
    async def scenario() -> None:
        passes = Passes()
        scheduler: PassScheduler[str, tuple[str, int]] = PassScheduler(passes, pass_timeout=0.05)
        with pytest.raises(TimeoutError):
            await scheduler.run("a")  # `release` never set: stuck
        passes.world = 1
        passes.release.set()
        assert await scheduler.run("a") == ("a", 1)
        assert passes.started == [0, 1]

    asyncio.run(scenario())
