"""A direct round's commit waits for the agent's copies (`finish_staged`): the engine
opens the agent's interprocess CUDA event and returns only once the work recorded before
it completed, in another process.

Run on a machine with a GPU: `pytest -m gpu tests/gpu/test_copies_event_gpu.py`.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from weightsync.engines.reference_arenas import CopiesEvents
from weightsync.reference.arenas import OpenedEvents

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 2_000_000_000  # about a second of GPU time before the copy


def _agent(queue: mp.Queue, done: mp.Event) -> None:  # type: ignore[type-arg]
    """Queue a long GPU sleep, then a write, then record the event (as the agent's packs)."""
    device = torch.device("cuda", 0)
    target = torch.zeros(1 << 20, device=device)
    event = CopiesEvents().get(device)
    for round_value in (1.0, 2.0):  # the same event, recorded again each round
        torch.cuda._sleep(SLEEP_CYCLES)
        target.fill_(round_value)
        event.record(torch.cuda.current_stream(device))
        queue.put((target, event.ipc_handle(), round_value))
        done.wait(60)
        done.clear()
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_engine_waits_for_the_agents_copies_event_across_processes() -> None:
    context = mp.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    agent = context.Process(target=_agent, args=(queue, done))
    agent.start()
    try:
        events = OpenedEvents(torch.device("cuda", 0))
        for _ in range(2):
            target, handle, value = queue.get(timeout=60)
            started = time.perf_counter()
            events.wait(handle)  # what `commit(after=handle)` does first
            waited = time.perf_counter() - started
            assert waited > 0.1, "returned before the agent's queued work ran"
            assert torch.all(target == value).item(), "the write before the event is visible"
            done.set()
    finally:
        agent.join(60)
    assert agent.exitcode == 0
