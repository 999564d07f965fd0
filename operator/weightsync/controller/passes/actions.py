"""What one pass decided to do (`decide.decide`), as values the apply step performs
(`apply.Applier`): the pass's result, the soft state after it, and the writes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from weightsync.api.v1alpha1 import WeightSyncStatus
from weightsync.controller.membership.plan import Desired
from weightsync.controller.membership.workloads import PodView
from weightsync.controller.passes.memory import SoftState
from weightsync.controller.readiness.gates import GateDecision
from weightsync.controller.recovery.decisions import Recoveries
from weightsync.controller.status.observed import EventSpec, Observation
from weightsync.controller.status.transitions import transition_events


class Outcome(StrEnum):
    OK = "ok"
    WAITING = "waiting"  # a referenced workload is missing: retry slowly
    INVALID = "invalid"  # the spec is wrong: nothing to do until it changes
    GONE = "gone"  # deleted, or being deleted


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    message: str = ""


@dataclass(frozen=True, slots=True)
class StatusWrite:
    """The status to write, if it differs from the stored one, and the Events for its
    transitions (posted only once it is written)."""

    old: WeightSyncStatus  # as read
    new: WeightSyncStatus
    events: tuple[EventSpec, ...]
    # What `new` was made from (`status.observed_status`): a pass that sends plans
    # writes their refusals from it once they come back (`apply.Applier.write_status`).
    made_from: Observation | None = None


def status_write(
    old: WeightSyncStatus, new: WeightSyncStatus, made_from: Observation | None = None
) -> StatusWrite:
    """`new` to write over `old`, with the Events for its transitions."""
    return StatusWrite(old, new, tuple(transition_events(old, new)), made_from)


@dataclass(frozen=True, slots=True)
class Plans:
    """A new generation's plans, to send to its members."""

    generation: int
    desired: Desired


@dataclass(frozen=True, slots=True)
class Actions:
    """Everything one pass does, in the order the apply step does it: recoveries, plans
    with the status, readiness gates, the token Secret, pods to recreate."""

    result: Result
    status: StatusWrite | None = None
    soft: SoftState | None = None  # the soft state after the pass (None: as it was)
    recoveries: Recoveries | None = None  # attempts to report, recoveries to start
    plans: Plans | None = None
    gates: tuple[GateDecision, ...] = ()  # readiness gates to flip
    write_token: bool = False  # apply this WeightSync's token Secret (once per object)
    recreate: tuple[PodView, ...] = ()  # opted-in pods the webhook missed
    # When the next pass runs: soon (a recovery's progress shows in no pod event) when
    # one is in flight, polling `watched` first, or a pod to recreate is still too young;
    # else at the next event or timer.
    poll_soon: bool = False
    watched: frozenset[str] = frozenset()
