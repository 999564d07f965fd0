"""Gate writes in the background: the newest decision for a pod wins, duplicates drop."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.unit.controller.builders import sink_view
from weightsync.controller.cluster.gatesync import REASON_SETTLE_SECONDS, GateSync
from weightsync.controller.readiness.gates import GateDecision


class SlowWriter:
    """Records each write; a write finishes when the test lets it."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str, str]] = []
        self.go = asyncio.Event()

    async def set_condition(self, namespace: str, pod: str, condition: dict[str, Any]) -> None:
        await self.go.wait()
        self.written.append((pod, condition["status"], condition["reason"]))


def decision(pod: str, status: bool, reason: str | None = None) -> GateDecision:
    return GateDecision(pod, status, reason or ("Yes" if status else "No"), "")


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


def test_a_reason_alone_is_written_once_it_has_held_and_a_move_at_once() -> None:
    async def scenario() -> None:
        writer = SlowWriter()
        writer.go.set()
        gates = GateSync(writer, "ns")  # type: ignore[arg-type]
        new = [sink_view("a")]  # no gate condition yet: the kubelet reads it as False
        gates.submit(new, [decision("a", False, "Behind")], now=100.0)
        gates.submit(new, [decision("a", False, "NotInRounds")], now=103.0)  # moved on
        gates.submit(new, [decision("a", False, "NotInRounds")], now=103.0 + 4.9)
        await gates.drain()
        assert writer.written == []  # nothing a pod's readiness depends on, yet
        gates.submit(new, [decision("a", False, "NotInRounds")], now=103.0 + REASON_SETTLE_SECONDS)
        await gates.drain()
        assert writer.written == [("a", "False", "NotInRounds")]
        # The gate opening is written at once, and so is its closing.
        shown = [sink_view("a", gate_status="False", gate_reason="NotInRounds")]
        gates.submit(shown, [decision("a", True)], now=200.0)
        await gates.drain()
        gates.submit(shown, [decision("a", False, "Behind")], now=200.0)  # watch still stale
        await gates.drain()
        assert writer.written[1:] == [("a", "True", "Yes"), ("a", "False", "Behind")]

    asyncio.run(scenario())
