"""P2P recovery of inference pods that are behind: who recovers, from whom, and when. Pure.

A sink pod whose agent answers and whose engine is alive but does not serve the current
version recovers: its agent pulls the newest held version at or after the current one
(of the current lineage) from the holders' host memory (`POST /v1/recover`).

* In no usable group generation (a replacement pod, a restarted agent): it is held out
  of the next generation until its recovery is `done`, then planned in like any
  newcomer.
* In a usable generation, with an engine its agent cannot vouch for (the engine's
  container restarted in place): it recovers where it stands, is not held out, and a
  round that starts meanwhile takes over (a round brings the whole version). An
  in-group sink that merely missed a version is left to the next round.

Its readiness gate follows what its agent vouches the engine serves, so it turns True
only at the current version. A pod whose engine is down is not asked: nothing could
load what it pulls.

If the current version moved on while it recovered, the pod is admitted anyway: the
next round (which it joins, pre-warmed) brings it current, and a trainer that publishes
faster than a pull completes could otherwise keep it recovering forever. Its gate stays
False until then.

With no holder of the current version (the trainer's agent restarted and holds nothing),
or none it can read (`pull_protocol.pull_over`: a pod on TCP cannot read RDMA holders),
the pod is admitted at once and waits for the next round, as without recovery.

A failed recovery is retried with exponential backoff; holders that failed it are left
out of the next attempt while others hold the version.

`decide_recoveries` makes one pass's decisions for every pod: the trackers after it, the
attempts to report, the requests to post, and which pods the pass holds out of the next
generation; the apply step carries them out (`apply.carry_out`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from weightsync.api.control import (
    AgentStatus,
    RecoverRequest,
    RecoveryState,
    RecoveryStatus,
    RecoveryTransport,
)
from weightsync.api.protocol import OLDEST
from weightsync.api.v1alpha1 import RecoveryProtocol, Role, SyncMode, WeightSyncSpec
from weightsync.controller.membership.plan import HOLDING_STATES
from weightsync.controller.membership.workloads import PodView
from weightsync.controller.readiness.gates import Current, served_version, serves
from weightsync.controller.recovery.pull_protocol import member_transport, pull_over

# What the agent is given for a whole pull: the round timeout scaled up, since a pull of
# the full model over TCP is far slower than one broadcast round, with a floor.
MIN_RECOVERY_TIMEOUT_SECONDS = 120.0

BACKOFF_BASE_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 60.0


def backoff_seconds(failures: int) -> float:
    """How long to wait after `failures` consecutive failed recoveries (2, 4, 8 … 60 s)."""
    if failures <= 0:
        return 0.0
    return min(BACKOFF_BASE_SECONDS * float(2 ** (failures - 1)), BACKOFF_MAX_SECONDS)


@dataclass
class Tracker:
    """What the operator remembers of one pod's recoveries (soft: a restart forgets it)."""

    failures: int = 0  # consecutive failed attempts
    retry_at: float = 0.0  # monotonic time before which no new attempt starts
    failed_holders: set[str] = field(default_factory=set)  # control URLs that failed it
    reported: int | None = None  # `started_at_unix_millis` of the last attempt reported

    def after(self, finished: RecoveryStatus | None, now: float) -> Tracker:
        """This tracker once the attempt that ended (`finished`, unreported) is counted."""
        if finished is None:
            return Tracker(self.failures, self.retry_at, set(self.failed_holders), self.reported)
        if finished.state is RecoveryState.FAILED:
            failures = self.failures + 1
            return Tracker(
                failures,
                now + backoff_seconds(failures),
                self.failed_holders | set(finished.holders_failed),
                finished.started_at_unix_millis,
            )
        return Tracker(reported=finished.started_at_unix_millis)


class Step(StrEnum):
    ADMIT = "admit"  # plan it as usual
    START = "start"  # post a RecoverRequest now
    WAIT = "wait"  # a recovery runs, or the backoff has not elapsed: hold it out


@dataclass(frozen=True, slots=True)
class Decision:
    pod: PodView
    step: Step
    holders: tuple[str, ...] = ()  # for START: the control URLs to pull from
    protocol: RecoveryProtocol = RecoveryProtocol.TCP  # for START: what those holders serve
    finished: RecoveryStatus | None = None  # an attempt that ended and was not reported yet
    in_group: bool = False  # it recovers where it stands: not held out of the group
    # The pod's tracker after this pass (`finished` counted): decided here, once.
    tracker: Tracker = field(default_factory=Tracker)


def enabled_for(spec: WeightSyncSpec, current: Current) -> bool:
    """Recovery applies to Disaggregated groups with recovery on, once a version exists."""
    return (
        spec.recovery.enabled
        and spec.mode is SyncMode.DISAGGREGATED
        and current.version is not None
    )


def agent_url(pod: PodView, default_port: int) -> str:
    return f"http://{pod.ip}:{pod.agent_port or default_port}"


def in_usable_generation(status: AgentStatus) -> bool:
    """Whether the agent is in a generation rounds can still update it through."""
    return any(g.state in HOLDING_STATES for g in status.generations)


def behind(status: AgentStatus, current: Current) -> bool:
    """Whether a sink must recover: alive, behind, and no round will soon update it."""
    engine = status.engine
    if status.role is not Role.SINK or engine is None or not engine.healthy:
        return False
    if serves(status, current):
        return False
    if in_usable_generation(status):  # restarted in place, or the next round's business
        return engine.version is None and not status.round_in_progress
    served = served_version(status)
    recovery = status.recovery
    # Recovered while the trainer moved on: admit it, the next round brings it current.
    return not (
        recovery is not None
        and recovery.state is RecoveryState.DONE
        and served is not None
        and served == recovery.version
    )


def holders_of(
    current: Current,
    pods: Sequence[PodView],
    statuses: Mapping[str, AgentStatus],
    default_port: int,
    *,
    excluding: str,
) -> list[str]:
    """Control URLs of the live agents holding `current` or a newer version of its
    lineage: sinks first, by name, then the source, so a sink holder spares the trainer's
    host when there is one."""
    found = [
        p
        for p in pods
        if p.name != excluding
        and p.running
        and not p.terminating
        and p.ip is not None
        and p.has_agent
        and _holds(statuses.get(p.name), current)
    ]
    found.sort(key=lambda p: (p.role is Role.SOURCE, p.name))
    return [agent_url(p, default_port) for p in found]


def _holds(status: AgentStatus | None, current: Current) -> bool:
    if status is None or status.holding is None or current.version is None:
        return False
    same = current.lineage is None or status.holding_lineage == current.lineage
    return same and status.holding >= current.version


def _unreported(status: AgentStatus, tracker: Tracker | None) -> RecoveryStatus | None:
    recovery = status.recovery
    if recovery is None or recovery.state not in (RecoveryState.DONE, RecoveryState.FAILED):
        return None
    if tracker is not None and tracker.reported == recovery.started_at_unix_millis:
        return None
    return recovery


def decide(
    pod: PodView,
    status: AgentStatus,
    current: Current,
    *,
    holders: Sequence[str],
    own: str,
    tracker: Tracker | None,
    now: float,
    transport: RecoveryTransport,
    served: Mapping[str, RecoveryTransport],
) -> Decision:
    """What to do about one joinable sink pod whose agent answered, this pass (`holders`:
    who holds `current`, `own` among them left out; `transport`: what the pod's agent
    pulls over, `served`: what each holder serves), and what its tracker becomes. One
    not answering is not planned anyway (`plan_recoveries` skips it)."""
    before = tracker or Tracker()
    finished = _unreported(status, before)
    after = before.after(finished, now)
    if not behind(status, current):
        return Decision(pod, Step.ADMIT, finished=finished, tracker=after)
    in_group = in_usable_generation(status)
    recovery = status.recovery
    running = recovery is not None and recovery.state in (
        RecoveryState.PENDING,
        RecoveryState.RUNNING,
    )
    if running or now < after.retry_at:
        return Decision(pod, Step.WAIT, finished=finished, in_group=in_group, tracker=after)
    # Filtered here, for the few that start, not for every sink of every pass.
    others = tuple(url for url in holders if url != own)
    readable = pull_over(transport, others, served)
    if readable is None:
        return Decision(pod, Step.ADMIT, finished=finished, tracker=after)
    protocol, others = readable
    fresh = tuple(url for url in others if url not in after.failed_holders)
    if not fresh:  # every holder failed once: all get another chance
        after.failed_holders.clear()
        fresh = others
    return Decision(
        pod,
        Step.START,
        holders=fresh,
        protocol=protocol,
        finished=finished,
        in_group=in_group,
        tracker=after,
    )


def start_refused(tracker: Tracker, now: float) -> None:
    """The agent refused the request (busy, unreachable): count it as a failure."""
    tracker.failures += 1
    tracker.retry_at = now + backoff_seconds(tracker.failures)


def plan_recoveries(
    spec: WeightSyncSpec,
    current: Current,
    *,
    pods: Sequence[PodView],
    statuses: Mapping[str, AgentStatus],
    trackers: Mapping[str, Tracker],
    now: float,
    default_port: int,
) -> list[Decision]:
    """A decision for each joinable sink pod with something to start, wait on or report;
    the others are admitted, their trackers as they were. None when recovery does not
    apply."""
    if not enabled_for(spec, current):
        return []
    decisions = []
    holding: list[str] | None = None  # once per pass, and only when a sink needs it
    served: dict[str, RecoveryTransport] = {}
    requested = spec.recovery.protocol
    for pod in pods:
        if pod.role is not Role.SINK or not pod.joinable:
            continue
        status, tracker = statuses.get(pod.name), trackers.get(pod.uid)
        # Every sink of every pass at a thousand pods (each with a tracker once it
        # recovered): most have nothing to decide.
        if status is None or not (_unreported(status, tracker) or behind(status, current)):
            continue
        if holding is None:
            holding = holders_of(current, pods, statuses, default_port, excluding="")
            served = {
                agent_url(p, default_port): member_transport(statuses[p.name], requested)
                for p in pods
                if p.name in statuses and p.ip is not None
            }
        decisions.append(
            decide(
                pod,
                status,
                current,
                holders=holding,
                own=agent_url(pod, default_port),
                tracker=tracker,
                now=now,
                transport=member_transport(status, requested),
                served=served,
            )
        )
    return decisions


@dataclass(frozen=True, slots=True)
class RecoveryPass:
    held_out: frozenset[str]  # pod names not to plan yet
    in_flight: bool  # a recovery runs or waits for its backoff: poll again soon
    watched: frozenset[str] = frozenset()  # the pods whose progress the follow-up polls


def request_for(
    spec: WeightSyncSpec, current: Current, holders: Sequence[str], protocol: RecoveryProtocol
) -> RecoverRequest:
    """`protocol`: what the holders serve (`pull_protocol.pull_over`), never `Auto`."""
    timeout = max(MIN_RECOVERY_TIMEOUT_SECONDS, 10.0 * spec.transfer.timeout_seconds)
    return RecoverRequest(
        version=current.version or 0,
        lineage=current.lineage or "",
        holders=list(holders),
        protocol=protocol,
        timeout_seconds=timeout,
    )


@dataclass(frozen=True, slots=True)
class RecoveryStart:
    """A recovery to ask a pod's agent for; `tracker` is the pod's (a refusal counts in it)."""

    pod: PodView
    request: RecoverRequest
    tracker: Tracker
    protocol_version: int  # its agent's (`api.protocol`): the request is written for it


@dataclass(frozen=True, slots=True)
class Recoveries:
    """One pass's recovery decisions: the trackers after it (by pod uid), the attempts
    that ended to report, the recoveries to start, and what the pass does meanwhile."""

    trackers: dict[str, Tracker]
    finished: tuple[Decision, ...]
    starts: tuple[RecoveryStart, ...]
    held: RecoveryPass


def decide_recoveries(
    *,
    spec: WeightSyncSpec,
    current: Current,
    pods: Sequence[PodView],
    statuses: Mapping[str, AgentStatus],
    trackers: Mapping[str, Tracker],
    now: float,
    default_port: int,
) -> Recoveries:
    """One pass of recovery decisions (`recovery.plan_recoveries`); `trackers` is left
    as it was."""
    live = {p.uid for p in pods}
    after = {uid: tracker for uid, tracker in trackers.items() if uid in live}
    decisions = plan_recoveries(
        spec,
        current,
        pods=pods,
        statuses=statuses,
        trackers=after,
        now=now,
        default_port=default_port,
    )
    held_out: set[str] = set()
    watched: set[str] = set()
    starts = []
    for decision in decisions:
        tracker = after[decision.pod.uid] = decision.tracker
        if decision.step is Step.START and current.version is not None:
            request = request_for(spec, current, decision.holders, decision.protocol)
            status = statuses.get(decision.pod.name)
            version = status.protocol_version if status is not None else OLDEST
            starts.append(RecoveryStart(decision.pod, request, tracker, version))
        if decision.step is not Step.ADMIT:
            watched.add(decision.pod.name)
            if not decision.in_group:
                held_out.add(decision.pod.name)
    held = RecoveryPass(frozenset(held_out), in_flight=bool(watched), watched=frozenset(watched))
    finished = tuple(d for d in decisions if d.finished is not None)
    return Recoveries(after, finished, tuple(starts), held)
