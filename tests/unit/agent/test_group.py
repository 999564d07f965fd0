"""Generations as real gloo groups, several ranks in one process (one thread each)."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest
import torch

from tests.integration.stack import free_port
from weightsync.agent.group import CollectiveThread, Group, GroupSpec, form_group
from weightsync.api.control import Backend
from weightsync.transfer.broadcast import TransferError


def specs(generation: int, world: int, port: int, *, prewarm: float = 20.0) -> list[GroupSpec]:
    return [
        GroupSpec(
            sync_name="unit",
            generation=generation,
            rank=rank,
            world_size=world,
            backend=Backend.GLOO,
            rendezvous_host="127.0.0.1",
            rendezvous_port=port,
            bind_host="127.0.0.1",
            device=torch.device("cpu"),
            collective_timeout_seconds=5.0,
            prewarm_timeout_seconds=prewarm,
        )
        for rank in range(world)
    ]


def broadcast_round(groups: list[Group], payload: torch.Tensor) -> list[torch.Tensor]:
    """One bucket broadcast plus the error vote on every rank; returns what each got."""
    buffers = [payload.clone() if g.spec.rank == 0 else torch.zeros_like(payload) for g in groups]

    async def one(group: Group, buffer: torch.Tensor) -> int:
        transport = group.transport
        work = await group.run(lambda: transport.start_bucket(buffer))
        deadline = time.monotonic() + 5
        await group.run(lambda: transport.wait(work, deadline=deadline, failure_key="f/0"))
        return await group.run(
            lambda: transport.agree_max(group.spec.rank, deadline=deadline, failure_key="f/0")
        )

    async def all_ranks() -> list[int]:
        return list(
            await asyncio.gather(*(one(g, b) for g, b in zip(groups, buffers, strict=True)))
        )

    assert asyncio.run(all_ranks()) == [len(groups) - 1] * len(groups)
    return buffers


def test_next_generation_prewarms_while_the_current_one_serves() -> None:
    port = free_port()

    async def scenario() -> None:
        current = await asyncio.gather(*(form_group(s) for s in specs(1, 3, port)))
        assert all(g.prewarm_seconds is not None and g.prewarm_seconds < 10 for g in current)
        forming = asyncio.gather(*(form_group(s) for s in specs(2, 2, port)))
        payload = torch.arange(4096, dtype=torch.int64).view(torch.uint8)
        # Generation 1 keeps moving buckets while generation 2 is being formed.
        for _ in range(3):
            results = await asyncio.gather(*(asyncio.to_thread(lambda: None) for _ in current))
            assert len(results) == 3
            got = await asyncio.to_thread(broadcast_round, list(current), payload)
            assert all(torch.equal(g, payload) for g in got)
        following = await forming
        got = await asyncio.to_thread(broadcast_round, list(following), payload)
        assert all(torch.equal(g, payload) for g in got)
        for group in [*current, *following]:
            group.close()

    asyncio.run(scenario())


def test_formation_times_out_when_a_member_never_comes() -> None:
    port = free_port()
    only_two = specs(3, 3, port, prewarm=1.5)[:2]

    async def scenario() -> list[BaseException | Group]:
        return list(
            await asyncio.gather(*(form_group(s) for s in only_two), return_exceptions=True)
        )

    started = time.monotonic()
    results = asyncio.run(scenario())
    assert time.monotonic() - started < 10
    assert all(isinstance(r, TransferError) for r in results), results


def test_a_peer_failure_key_stops_a_waiting_rank() -> None:
    port = free_port()

    async def scenario() -> None:
        groups = await asyncio.gather(*(form_group(s) for s in specs(4, 2, port)))
        source, sink = groups
        buffer = torch.zeros(1024, dtype=torch.uint8)
        work = await sink.run(lambda: sink.transport.start_bucket(buffer))
        await source.run(lambda: source.ctl.set("failed/7", "source: publisher_gone"))
        started = time.monotonic()
        with pytest.raises(TransferError) as error:
            await sink.run(
                lambda: sink.transport.wait(work, deadline=started + 30, failure_key="failed/7")
            )
        assert error.value.reason == "peer_failed"
        assert time.monotonic() - started < 2
        for group in groups:
            group.abort("test over")
            group.close()

    asyncio.run(scenario())


def test_a_round_on_a_closed_generation_fails_as_a_named_transfer_failure() -> None:
    """The 100-fault matrix saw `internal_error: RuntimeError('the collective thread is
    stopped')`: a round reached a generation retired under it."""
    worker = CollectiveThread("test-coll")
    assert worker.submit(lambda: 7).result(timeout=5) == 7
    worker.stop()
    with pytest.raises(TransferError) as failure:
        worker.submit(lambda: 8)
    assert failure.value.reason == "generation_closed"


def test_a_doorbell_answered_after_the_agent_stopped_ends_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI saw a traceback in a replaced engine pod's agent log: its doorbell thread, woken
    after the agent's event loop had closed, raised `Event loop is closed`."""
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    loop = asyncio.new_event_loop()
    group = loop.run_until_complete(form_group(specs(1, 1, free_port())[0]))
    waiting = loop.create_task(group.wait_key("bell/0", timedelta(seconds=30)))
    loop.run_until_complete(asyncio.sleep(0.2))  # its thread is in the store's wait
    waiting.cancel()
    loop.run_until_complete(asyncio.gather(waiting, return_exceptions=True))
    loop.close()
    group.ctl.set("bell/0", b"ring")  # wakes the thread, which has nobody left to tell
    threads = [t for t in threading.enumerate() if t.name == "ws-g1-doorbell"]
    assert threads
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    group.close()
    assert raised == []
