"""Gate writes in the background: the newest decision for a pod wins, duplicates drop."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.unit.controller.builders import sink_view
from weightsync.controller.gatesync import GateSync
from weightsync.controller.readiness import GateDecision


class SlowWriter:
    """Records each write; a write finishes when the test lets it."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str, str]] = []
        self.go = asyncio.Event()

    async def set_condition(self, namespace: str, pod: str, condition: dict[str, Any]) -> None:
        await self.go.wait()
        self.written.append((pod, condition["status"], condition["reason"]))


def decision(pod: str, status: bool) -> GateDecision:
    return GateDecision(pod, status, "Yes" if status else "No", "")


def test_the_newest_decision_is_written_last_and_duplicates_are_dropped() -> None:
    async def scenario() -> None:
        writer = SlowWriter()
        gates = GateSync(writer, "ns")  # type: ignore[arg-type]
        pods = [sink_view("a"), sink_view("b")]
        gates.submit(pods, [decision("a", True), decision("b", True)])
        await asyncio.sleep(0)  # both writes in flight
        gates.submit(pods, [decision("a", True), decision("b", False)])  # a: no news
        gates.submit(pods, [decision("b", False)])  # b: already waiting
        assert gates.pending == 3
        writer.go.set()
        await gates.drain()
        assert writer.written == [("a", "True", "Yes"), ("b", "True", "Yes"), ("b", "False", "No")]
        # A decision that returns to what is in flight cancels the one waiting behind it.
        writer.go.clear()
        gates.submit(pods, [decision("a", False)])
        await asyncio.sleep(0)
        gates.submit(pods, [decision("a", True)])
        gates.submit(pods, [decision("a", False)])
        writer.go.set()
        await gates.drain()
        assert writer.written[3:] == [("a", "False", "No")]
        assert gates.pending == 0

    asyncio.run(scenario())


def test_a_written_gate_is_not_written_again_while_the_watch_catches_up() -> None:
    async def scenario() -> None:
        writer = SlowWriter()
        writer.go.set()
        gates = GateSync(writer, "ns")  # type: ignore[arg-type]
        stale = [sink_view("a")]  # the pod as the watch still shows it
        gates.submit(stale, [decision("a", True)])
        await gates.drain()
        gates.submit(stale, [decision("a", True)])  # a pass before the watch event
        await gates.drain()
        assert writer.written == [("a", "True", "Yes")]
        # Someone else changed it meanwhile: written again.
        changed = [sink_view("a", gate_status="False", gate_reason="ContainersNotReady")]
        gates.submit(changed, [decision("a", True)])
        await gates.drain()
        assert len(writer.written) == 2

    asyncio.run(scenario())
