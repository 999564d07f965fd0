"""`runtime.tasks`: the one place background tasks start, are kept and are cancelled."""

from __future__ import annotations

import asyncio

from weightsync.controller.runtime.tasks import Tasks


def test_spawned_tasks_are_named_kept_until_done_and_shared_with_the_parent() -> None:
    async def scenario() -> None:
        tasks = Tasks()
        group = tasks.child()
        release = asyncio.Event()
        waiting = group.spawn("gate ns/pod-0", release.wait())
        quick = tasks.spawn("pass ('ns', 'sync')", asyncio.sleep(0))
        assert waiting.get_name() == "gate ns/pod-0"
        assert set(tasks) == {waiting, quick}
        assert set(group) == {waiting}
        await quick
        assert set(tasks) == {waiting}
        release.set()
        await group.wait(1.0)
        await asyncio.sleep(0)  # the done callbacks
        assert len(tasks) == 0
        assert len(group) == 0

    asyncio.run(scenario())


def test_cancel_all_cancels_every_task_still_running_children_included() -> None:
    async def scenario() -> None:
        tasks = Tasks()
        forever = asyncio.Event()
        mine = tasks.spawn("pod watch", forever.wait())
        theirs = tasks.child().spawn("event ns/sync", forever.wait())
        await asyncio.sleep(0)
        assert tasks.cancel_all() == 2
        await asyncio.gather(mine, theirs, return_exceptions=True)
        assert mine.cancelled()
        assert theirs.cancelled()
        assert len(tasks) == 0

    asyncio.run(scenario())


def test_wait_gives_up_after_its_seconds() -> None:
    async def scenario() -> None:
        tasks = Tasks()
        forever = asyncio.Event()
        task = tasks.spawn("plans ns/sync", forever.wait())
        await tasks.wait(0.01)
        assert not task.done()
        tasks.cancel_all()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
