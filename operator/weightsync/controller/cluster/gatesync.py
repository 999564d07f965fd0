"""A WeightSync's readiness gates, written in the background of its passes.

A thousand gate writes take seconds however they are sent (the API server takes a
few ms for each, and there is no batch write). Awaited inside a pass, they held up the
next pass, and with it new members, for as long. So a pass hands its decisions here
and goes on; the writes go out many at a time (`apiwriter`), and a pod's gate is
written with the newest decision for it, never an older one after a newer:

* a decision for a pod whose write is in flight replaces the one waiting behind it;
* a decision equal to the one being written or waiting is dropped, and so is one equal
  to the last write while the pod still shows what it showed before that write (the
  watch has not brought the write back yet): the passes that run meanwhile add nothing.

A decision that only changes the reason of a gate that stays False (a pod with no
gate condition yet counts as False: the kubelet reads a missing condition as False) is
written once it has held for `REASON_SETTLE_SECONDS`: no pod's readiness depends on it,
and a newcomer's reasons change every second or two on its way in (containers not
ready, behind, not yet in rounds): four writes a pod at a scale-up, each a few ms of the
API server's CPU and a watch event to every pod watcher, for one that matters (True).
Any change of the gate's status is written at once.

A failed write is logged and forgotten: the next pass sees the pod's gate unchanged
and decides again (level-based; kopf's timer guarantees a next pass).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from weightsync.api.base import format_timestamp, utc_now
from weightsync.api.reasons import listing
from weightsync.controller import names
from weightsync.controller.cluster.apiwriter import ApiWriter
from weightsync.controller.cluster.kube import pod_condition
from weightsync.controller.membership.workloads import PodView
from weightsync.controller.readiness.gates import GateDecision
from weightsync.controller.runtime.tasks import Tasks
from weightsync.controller.settings import DEFAULT_RESYNC_SECONDS

log = logging.getLogger(__name__)

REASON_SETTLE_SECONDS = DEFAULT_RESYNC_SECONDS  # the drift timer's period: a pass comes by


class GateSync:
    """The gate writes of one WeightSync (soft state of the reconciler)."""

    def __init__(self, writer: ApiWriter, namespace: str, tasks: Tasks | None = None) -> None:
        self._writer = writer
        self._namespace = namespace
        # pod -> (decision, since, what the pod showed when it was decided)
        self._wanted: dict[str, tuple[GateDecision, str, tuple[str | None, str | None]]] = {}
        self._writing: dict[str, GateDecision] = {}  # pod -> the decision being written
        # pod -> (the gate written, what the pod showed before): until the watch shows it
        self._written: dict[str, tuple[tuple[bool, str], tuple[str | None, str | None]]] = {}
        self._tasks = (tasks or Tasks()).child()
        # pod -> (status, reason) of a reason-only change, and when it was first decided
        self._settling: dict[str, tuple[tuple[bool, str], float]] = {}
        self.failures = 0

    def submit(
        self, pods: Sequence[PodView], changes: Sequence[GateDecision], now: float | None = None
    ) -> None:
        """Write `changes` (`readiness.gate_changes`) without waiting for them; `now`: a
        monotonic time (tests), for reason-only changes (`REASON_SETTLE_SECONDS`)."""
        stamp = format_timestamp(utc_now())
        by_name = {p.name: p for p in pods}
        self._settle(by_name)
        queued = []
        for decision in self._settled(by_name, changes, time.monotonic() if now is None else now):
            pod = decision.pod
            written = self._written.get(pod)
            shown = (by_name[pod].gate_status, by_name[pod].gate_reason)
            if written is not None and written == ((decision.status, decision.reason), shown):
                continue  # written already; the pod's watch event is on its way
            if _same(self._writing.get(pod), decision):
                self._wanted.pop(pod, None)  # what is being written is the newest word
                continue
            waiting = self._wanted.get(pod)
            if waiting is not None and _same(waiting[0], decision):
                continue
            queued.append(decision)
            view = by_name[pod]
            # lastTransitionTime moves only when the status flips, as for any condition.
            kept = view.gate_since if view.gate_status == decision.status_text else None
            self._wanted[pod] = (decision, kept or stamp, shown)
            if pod not in self._writing:
                self._tasks.spawn(f"gate {self._namespace}/{pod}", self._write(pod))
        if queued:
            opened = sum(1 for d in queued if d.status)
            log.info(
                "gates of %s: %d to open, %d to close (%s)",
                self._namespace, opened, len(queued) - opened,
                listing([f"{d.pod}: {d.status_text} ({d.reason})" for d in queued], shown=3),
            )  # fmt: skip

    def _settled(
        self, pods: dict[str, PodView], changes: Sequence[GateDecision], now: float
    ) -> list[GateDecision]:
        """`changes` less the reason-only ones that have not held long enough yet."""
        result = []
        settling = {}
        for decision in changes:
            if decision.status != self._gate(pods[decision.pod]):
                result.append(decision)  # the gate moves: now
                continue
            key = (decision.status, decision.reason)
            seen = self._settling.get(decision.pod)
            since = seen[1] if seen is not None and seen[0] == key else now
            if now - since >= REASON_SETTLE_SECONDS:
                result.append(decision)
            else:
                settling[decision.pod] = (key, since)
        self._settling = settling  # a pod whose decision moved on starts over
        return result

    def _gate(self, view: PodView) -> bool:
        """The gate's status as the pod will show it: the newest decision on its way there
        (waiting, being written, or written while the watch still shows the pod as it was
        before), else what it shows."""
        pod = view.name
        if pod in self._wanted:
            return self._wanted[pod][0].status
        if pod in self._writing:
            return self._writing[pod].status
        written = self._written.get(pod)
        if written is not None and written[1] == (view.gate_status, view.gate_reason):
            return written[0][0]  # the pod shows what it showed before that write
        return view.gate_status == "True"

    def _settle(self, pods: dict[str, PodView]) -> None:
        """Forget the writes the watch has brought back, and those of pods that left."""
        for pod, (gate, _) in list(self._written.items()):
            view = pods.get(pod)
            if view is None or (view.gate_status == ("True" if gate[0] else "False")
                                and view.gate_reason == gate[1]):  # fmt: skip
                del self._written[pod]

    async def _write(self, pod: str) -> None:
        while pod in self._wanted:
            decision, since, before = self._wanted.pop(pod)
            self._writing[pod] = decision
            condition = pod_condition(
                kind=names.WEIGHTS_CURRENT,
                status=decision.status_text,
                reason=decision.reason,
                message=decision.message,
                since=since or format_timestamp(utc_now()),
            )
            try:
                await self._writer.set_condition(self._namespace, pod, condition)
                self._written[pod] = ((decision.status, decision.reason), before)
            except Exception as error:
                self.failures += 1
                log.warning(
                    "gate of %s/%s not written (%s); the next pass decides again",
                    self._namespace, pod, error,
                )  # fmt: skip
            finally:
                del self._writing[pod]

    @property
    def pending(self) -> int:
        """Gates waiting or being written."""
        return len(self._wanted) + len(self._writing)

    async def drain(self) -> None:
        """Wait for every write submitted so far (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _same(a: GateDecision | None, b: GateDecision) -> bool:
    return a is not None and (a.status, a.reason) == (b.status, b.reason)
