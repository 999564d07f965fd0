"""Every task the operator runs in the background, started here and nowhere else.

kopf runs the handlers; everything else that runs beside them is a task started through
one `Tasks` (built in `main`), so this module's callers are the list of what runs in the
background, each task is named (a SIGUSR1 dump, `taskdump`, shows them), and a stopping
operator cancels what is left (`cancel_all`):

* the pod watch (`handlers`: started at startup, cancelled first at cleanup);
* a pass asked for by an event, after its delay (`passes.scheduling.PassScheduler.request`);
* a follow-up pass while a recovery runs (`passes.reconcile.Reconciler`);
* new agents asked for their first answer (`passes.observe.Observer.answers`);
* a new generation's plans going out (`passes.apply.Applier.send_plans`);
* readiness gates written (`cluster.gatesync.GateSync`), and a gate closed at once on a
  pod event (`handlers.Shared.pod_changed`);
* Events posted (`cluster.events.EventPoster`).

An owner that waits for its own tasks (Events drained at shutdown, gate writes in tests)
holds a `child()`: its tasks are the parent's too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Tasks:
    """Background tasks started from the running event loop, kept until they end."""

    def __init__(self, parent: Tasks | None = None) -> None:
        self._parent = parent
        self._running: set[asyncio.Task[Any]] = set()

    def child(self) -> Tasks:
        """A group of this one's: its tasks are kept (and cancelled) here too."""
        return Tasks(self)

    def spawn(self, name: str, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `work` in the background as a task named `name`; its handle is kept until
        it ends (the loop keeps only a weak reference)."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._keep(task)
        return task

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        if self._parent is not None:
            self._parent._keep(task)

    def __len__(self) -> int:
        return len(self._running)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(set(self._running))

    def cancel_all(self) -> int:
        """Cancel every task still running (the operator is stopping); how many."""
        running = [task for task in self._running if not task.done()]
        for task in running:
            task.cancel()
        return len(running)

    async def wait(self, seconds: float | None = None) -> None:
        """Wait up to `seconds` for the tasks running now (not those they start)."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=seconds)
