"""Two kopf operators in one event loop, each stopped on its own.

With leader election (`controller.leader`) every replica runs a *serving* operator
(admission webhooks, and the indexes they read) and the Lease's holder also a *leading*
one (the reconcile, its timers, the pod watch). kopf is built to be alone in its loop:
when `kopf.run_tasks` ends it waits for, then cancels, every task created since the
operator started ("the loop is not fully ours", kopf's `running.py`), which would take the
other operator's tasks with it; and every `kopf.spawn_tasks` takes over SIGINT and SIGTERM.
So:

* each operator's tasks carry its name: a task factory records, for every task created,
  the operator named by a context variable, which every task inherits from its creator;
  an operator's end then waits only for its own (`_NotOwnedBy`);
* the caller's signal handlers are put back after each operator starts (`restore_signals`),
  so that the caller decides the order in which they stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Coroutine, Iterator
from contextvars import Context, ContextVar
from typing import Any
from weakref import WeakKeyDictionary

import kopf

_OWNER: ContextVar[str | None] = ContextVar("weightsync_kopf_operator", default=None)
_OWNERS: WeakKeyDictionary[asyncio.Task[Any], str | None] = WeakKeyDictionary()


def track_owners(loop: asyncio.AbstractEventLoop) -> None:
    """Record which operator (if any) creates each task of `loop` from now on."""

    def factory(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any],
        context: Context | None = None,
        **kwargs: Any,
    ) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, context=context, **kwargs)
        _OWNERS[task] = context.get(_OWNER) if context is not None else _OWNER.get()
        return task

    loop.set_task_factory(factory)  # type: ignore[arg-type]


def owner(task: asyncio.Task[Any]) -> str | None:
    return _OWNERS.get(task)


class _NotOwnedBy(Collection[asyncio.Task[Any]]):
    """The tasks kopf's `run_tasks` must leave alone: every task not of operator `name`
    (it only asks `task in ignored`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __contains__(self, task: object) -> bool:
        return not isinstance(task, asyncio.Task) or _OWNERS.get(task) != self.name

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(())

    def __len__(self) -> int:
        return 0


async def run_operator(
    name: str, *, restore_signals: Callable[[], None], **kopf_kwargs: Any
) -> None:
    """One kopf operator named `name`, until its `stop_flag` (in `kopf_kwargs`) is set.
    Run it as a task of its own (`asyncio.create_task`): its context is the operator's."""
    _OWNER.set(name)
    tasks = await kopf.spawn_tasks(**kopf_kwargs)
    restore_signals()
    await kopf.run_tasks(tasks, ignored=_NotOwnedBy(name))
