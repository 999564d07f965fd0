"""What the reconciler keeps per WeightSync between passes: the decisions' soft state
(`SoftState`), and the runtime's tasks, locks and caches beside it (`Memory`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, fields
from typing import Any

from weightsync.api.v1alpha1 import WeightSyncStatus
from weightsync.controller.agents.client import AgentAddress
from weightsync.controller.agents.view import AgentView
from weightsync.controller.cluster.gatesync import GateSync
from weightsync.controller.membership.plan import Slot
from weightsync.controller.recovery.decisions import Tracker


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
class SoftState:
    """What the decisions of one pass remember for the next (`decide.decide` reads a copy
    and returns the state after it; the pass adopts it, `Memory.adopt`). Soft: losing it
    (a restart) costs at most a slower timeout and one poll of every agent. Written by
    `decide` only, except where a field says otherwise."""

    # When the pre-warm timeout of a generation started: its delivery, if planned here,
    # else the first pass that saw it (planned before a restart). The delivery restamps
    # it once its plans went out (`generations.Planner.sent`).
    planned_at: dict[int, float] = field(default_factory=dict)
    # The last few generations this process delivered (`readiness.rounds_reach`); the
    # delivery restamps them too.
    deliveries: dict[int, Delivery] = field(default_factory=dict)
    # Pod uid -> monotonic deadline; the delivery adds pods that refused their plans.
    cooldown: dict[str, float] = field(default_factory=dict)
    # The planned generation given up on at its pre-warm timeout: its cold members sat
    # out once (not again on every pass), and the next formable group is a new generation.
    abandoned: int | None = None
    formed: int | None = None  # the last planned generation seen warm on every member
    newcomers_since: float | None = None  # monotonic: since when joinable pods wait to join
    # The last generation this process planned and delivered, with its members, until a
    # status read back records it (`planned`).
    unsaved: Unsaved | None = None
    # By pod uid; the apply step counts a refused start in place (`recovery.start_refused`).
    recoveries: dict[str, Tracker] = field(default_factory=dict)

    def copy(self) -> SoftState:
        """A copy a pass may change without touching this one (trackers are replaced,
        never changed, by a decision: the tables are copied, not their entries)."""
        return SoftState(
            planned_at=dict(self.planned_at),
            deliveries=dict(self.deliveries),
            cooldown=dict(self.cooldown),
            abandoned=self.abandoned,
            formed=self.formed,
            newcomers_since=self.newcomers_since,
            unsaved=self.unsaved,
            recoveries=dict(self.recoveries),
        )

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


@dataclass
class Memory(SoftState):
    """Everything the reconciler keeps per WeightSync between passes: the decisions' soft
    state (`SoftState`), and beside it the runtime's tasks, locks and caches, each field
    saying who writes it. Losing it (a restart) costs at most a slower timeout and one
    poll of every agent."""

    # The apply step (the `Reconciler` clears `poll_soon` as a pass starts): the last pass
    # left a recovery in flight, and the pods a follow-up pass polls (those recoveries).
    poll_soon: bool = False
    watched: frozenset[str] = frozenset()
    poll: asyncio.Task[None] | None = None  # the pending follow-up pass (`Reconciler`)
    token_written_for: str | None = None  # the apply step: the uid whose token Secret it wrote
    # The agents' latest answers: the observe step, sweeps and follow-ups record them.
    agents: AgentView = field(default_factory=AgentView)
    # What the drift timer's sweep polls (the observe step): the last pass's agents and
    # their token, and of those the trainer's (the source timer's).
    addresses: list[AgentAddress] = field(default_factory=list)
    token: str = ""
    sources: frozenset[str] = frozenset()
    # Held by the drift timer's sweep (`Reconciler`): one sweep at a time.
    sweeping: asyncio.Lock = field(default_factory=asyncio.Lock)
    gates: GateSync | None = None  # the apply step's gate writes, in the background
    # The observe step's read cache: the WeightSync's newest version a pass used, and the
    # apply step's last status write: (the version it was made on, the object it
    # returned). See `observe.Observer.read`.
    seen_version: str | None = None
    written: tuple[str, dict[str, Any]] | None = None
    stored: tuple[str, WeightSyncStatus] | None = None  # the observe step: status parsed
    # The pass running now, or the last one: a new one at each pass's start (`Reconciler`).
    laps: Laps = field(default_factory=Laps)
    # New agents being asked for their first answer, and those polls (the observe step).
    asking: set[str] = field(default_factory=set)
    asks: set[asyncio.Task[None]] = field(default_factory=set)
    # The last new generation's plans going out, with their refusals by pod once sent
    # (the apply step): no newer generation is planned until they are.
    sending: asyncio.Task[dict[str, str]] | None = None

    def adopt(self, soft: SoftState) -> None:
        """Take the soft state a pass decided on (`decide.Actions.soft`). Called with no
        await since the decision: nothing else changed the state meanwhile."""
        for name in (f.name for f in fields(SoftState)):
            setattr(self, name, getattr(soft, name))
