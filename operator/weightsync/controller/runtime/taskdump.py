"""`kill -USR1 <operator>`: log where every asyncio task and thread of the operator is.

An operator that stops acting while it still answers probes (no pass, no log line) is
stuck in some await; this names which one, without a debugger in the pod.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import traceback

log = logging.getLogger(__name__)


def describe() -> str:
    """Every task of the running loop with its stack, then every thread's stack."""
    lines: list[str] = []
    tasks = sorted(asyncio.all_tasks(), key=lambda task: task.get_name())
    lines.append(f"{len(tasks)} asyncio tasks:")
    for task in tasks:
        lines.append(f"* {task.get_name()}:")
        lines.extend(f"    {where}" for where in awaits(task.get_coro()))
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames_by_thread = sys._current_frames()
    lines.append(f"{len(frames_by_thread)} threads:")
    for ident, frame in frames_by_thread.items():
        stack = "".join(traceback.format_stack(frame)[-4:])
        lines.append(f"* thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(lines)


def awaits(coro: object) -> list[str]:
    """The chain of awaits a coroutine is suspended in, outermost first (what
    `Task.get_stack` does not show: it stops at the task's own coroutine)."""
    chain: list[str] = []
    while coro is not None and len(chain) < 64:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        frame = frame or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            chain.append(f"{code.co_name} ({code.co_filename}:{frame.f_lineno})")
        else:
            chain.append(repr(coro))
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "ag_await", None)
            or getattr(coro, "gi_yieldfrom", None)
        )
    return chain


def install(loop: asyncio.AbstractEventLoop) -> None:
    loop.add_signal_handler(signal.SIGUSR1, lambda: log.warning("%s", describe()))
