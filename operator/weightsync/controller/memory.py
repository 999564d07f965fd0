"""The reconciler's soft per-WeightSync state."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.api.v1alpha1 import WeightSyncStatus
from weightsync.controller.agents import AgentAddress
from weightsync.controller.agentview import AgentView
from weightsync.controller.gatesync import GateSync
from weightsync.controller.plan import Slot
from weightsync.controller.recovery import Tracker


@dataclass(frozen=True)
class Unsaved:
    """A generation planned and delivered here that no status read back records yet."""

    generation: int
    members: list[Slot]
    spec_generation: int  # the WeightSync's metadata.generation it was planned from


@dataclass(frozen=True)
class Delivery:
    """A generation's plans as delivered by this process: to whom, and when (monotonic,
    once every plan was sent)."""

    members: frozenset[str]
    at: float


class Laps:
    """Where one pass spent its time, step by step (the log line of a slow pass)."""

    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()
        self._laps: list[tuple[str, float]] = []

    def __call__(self, step: str) -> None:
        """`step` ended now."""
        now = time.perf_counter()
        self._laps.append((step, now - self._last))
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self.started

    def __str__(self) -> str:
        return ", ".join(f"{step} {seconds:.2f}" for step, seconds in self._laps)


KEEP_DELIVERIES = 4  # the source runs in its newest warm one: at most a few back


@dataclass
class Memory:
    """Soft per-WeightSync state; losing it (a restart) costs at most a slower timeout
    and one poll of every agent."""

    # When the pre-warm timeout of a generation started: its delivery, if planned here,
    # else the first pass that saw it (planned before a restart).
    planned_at: dict[int, float] = field(default_factory=dict)
    # The last few generations this process delivered (`readiness.rounds_reach`).
    deliveries: dict[int, Delivery] = field(default_factory=dict)
    cooldown: dict[str, float] = field(default_factory=dict)  # pod uid -> monotonic deadline
    # The planned generation given up on at its pre-warm timeout: its cold members sat
    # out once (not again on every pass), and the next formable group is a new generation.
    abandoned: int | None = None
    formed: int | None = None  # the last planned generation seen warm on every member
    newcomers_since: float | None = None  # monotonic: since when joinable pods wait to join
    # The last generation this process planned and delivered, with its members, until a
    # status read back records it (`planned`).
    unsaved: Unsaved | None = None
    recoveries: dict[str, Tracker] = field(default_factory=dict)  # by pod uid
    poll_soon: bool = False  # the last pass left a recovery in flight
    poll: asyncio.Task[None] | None = None  # the pending follow-up pass
    token_written_for: str | None = None  # the WeightSync uid whose token Secret was applied
    agents: AgentView = field(default_factory=AgentView)  # the agents' latest answers
    # What the drift timer's sweep polls: the last pass's agents and their token.
    addresses: list[AgentAddress] = field(default_factory=list)
    token: str = ""
    sources: frozenset[str] = frozenset()  # of those, the trainer's (the source timer's)
    sweeping: asyncio.Lock = field(default_factory=asyncio.Lock)  # one sweep at a time
    watched: frozenset[str] = frozenset()  # pods a follow-up pass polls (recoveries)
    gates: GateSync | None = None  # its gate writes, in the background of the passes
    # The WeightSync's newest version a pass used, and the last status write: (the
    # version it was made on, the object it returned). See `Reconciler._read`.
    seen_version: str | None = None
    written: tuple[str, dict[str, Any]] | None = None
    stored: tuple[str, WeightSyncStatus] | None = None  # the status parsed, by version
    laps: Laps = field(default_factory=Laps)  # the pass running now, or the last one
    # New agents being asked for their first answer, and those polls (`Reconciler._ask`).
    asking: set[str] = field(default_factory=set)
    asks: set[asyncio.Task[None]] = field(default_factory=set)
    # The last new generation's plans going out, with their refusals by pod once sent
    # (`Reconciler._send_plans`): no newer generation is planned until they are.
    sending: asyncio.Task[dict[str, str]] | None = None

    def delivered(self, generation: int, members: list[Slot], at: float) -> None:
        self.deliveries[generation] = Delivery(frozenset(s.pod for s in members), at)
        for number in sorted(self.deliveries)[:-KEEP_DELIVERIES]:
            del self.deliveries[number]

    def unheard(self, seen: AgentView) -> dict[int, frozenset[str]]:
        """For `readiness.rounds_reach`: by generation this process delivered, the members
        with no answer in `seen` (a pass's answers) asked since the delivery.
        Generations delivered before a restart are not known: every answer counts."""
        return {
            generation: sent.members - seen.since(sent.at).keys()
            for generation, sent in self.deliveries.items()
        }

    def planned(self, stored: int | None, members: list[Slot]) -> tuple[int | None, list[Slot]]:
        """The planned generation and its members: the stored status's, or a newer one
        planned here whose status write has not been read back yet. With the API server
        away, the status keeps naming an older generation while the agents already hold
        the new one; planning from the status would then give them another generation on
        every pass (one a second), and none would ever form."""
        if self.unsaved is not None:
            if self.unsaved.generation > (stored or 0):
                return self.unsaved.generation, self.unsaved.members
            self.unsaved = None  # the status has caught up
        return stored, members
