"""`kill -USR1` on the operator logs where each task waits, down to the innermost await."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from weightsync.controller.runtime import taskdump


async def stuck_in_a_pass(never: asyncio.Event) -> None:
    await never.wait()


def test_sigusr1_logs_each_task_with_its_chain_of_awaits(caplog: pytest.LogCaptureFixture) -> None:
    asyncio.run(dump_one_stuck_task(caplog))


async def dump_one_stuck_task(caplog: pytest.LogCaptureFixture) -> None:
    never = asyncio.Event()
    task = asyncio.create_task(stuck_in_a_pass(never), name="pass ('ns', 'sync')")
    loop = asyncio.get_running_loop()
    taskdump.install(loop)
    try:
        await asyncio.sleep(0)
        with caplog.at_level(logging.WARNING, logger=taskdump.__name__):
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(100):
                if caplog.records:
                    break
                await asyncio.sleep(0.01)
        (record,) = caplog.records
        text = record.getMessage()
        entry = text.split("* pass ('ns', 'sync'):\n", 1)[1].splitlines()
        assert entry[0].strip().startswith("stuck_in_a_pass (")
        assert entry[1].strip().startswith("wait (")  # Event.wait, where it is stuck
        assert "threads:" in text
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        task.cancel()
