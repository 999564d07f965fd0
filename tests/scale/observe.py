"""What the scale harness watches: pods and the WeightSync (through watches, stamped on
arrival), the operator's pass durations (from its own metrics) and its memory.

Everything runs on daemon threads and keeps only the few fields the report needs; the
harness waits on them with `wait_for` (a condition variable, no sleeps).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

from weightsync.api import GROUP, PLURAL, VERSION
from weightsync.controller import names

PASS_METRIC = "weightsync_operator_reconcile_duration_seconds"


@dataclass(frozen=True, slots=True)
class PodState:
    running: bool
    ip: str | None
    gate: str | None  # the weights-current condition's status
    gate_reason: str | None


def _pod_state(pod: dict[str, Any]) -> PodState:
    status = pod.get("status") or {}
    gate = next(
        (c for c in status.get("conditions") or [] if c.get("type") == names.WEIGHTS_CURRENT), {}
    )
    return PodState(
        running=status.get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp"),
        ip=status.get("podIP"),
        gate=gate.get("status"),
        gate_reason=gate.get("reason"),
    )


class Watched:
    """A condition variable over a snapshot that watch threads update."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.error: BaseException | None = None

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Block until `predicate()` is truthy (its value, and the time it first was)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                value = predicate()
                if value:
                    return value
                if self.error is not None:
                    raise RuntimeError(f"watch failed while waiting for {what}") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what}: not after {timeout:.0f} s")
                self.changed.wait(min(left, 1.0))


def _stream(list_fn: Any, sink: Any) -> None:
    """Feed every event of a watch to `sink(type, obj, at)`; each (re)connection starts
    with the objects that exist (synthetic ADDED events), so a server-ended watch loses
    nothing."""
    while True:
        events = watch.Watch().stream(list_fn, deserialize=False)
        while True:
            try:
                event = next(events)
            except StopIteration:
                break
            except KeyError:  # an ERROR event (410 Gone: the server dropped our version):
                break  # the client reads its `raw_object`, absent without deserializing
            sink(event["type"], event["object"], time.monotonic())


class PodWatch(Watched):
    """The namespace's pods with app=`app`: their state now, and when each gate moved."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        app: str,
        addressed: Callable[[str, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.pods: dict[str, PodState] = {}
        self.addressed = addressed  # called with (ip, pod) for each address a pod gets
        self.moves = 0
        self.moved_pods: set[str] = set()  # the pods KWOK gave a second address
        # (at, pod, gate status, its reason)
        self.gate_changes: list[tuple[float, str, str | None, str | None]] = []
        core = client.CoreV1Api(api)

        def list_fn(**kwargs: Any) -> Any:
            return core.list_namespaced_pod(namespace, label_selector=f"app={app}", **kwargs)

        def run() -> None:
            try:
                _stream(list_fn, self._event)
            except BaseException as error:
                with self.changed:
                    self.error = error
                    self.changed.notify_all()

        threading.Thread(target=run, name=f"watch-pods-{app}", daemon=True).start()

    def _event(self, kind: str, pod: dict[str, Any], at: float) -> None:
        name = pod["metadata"]["name"]
        address = None
        with self.changed:
            before = self.pods.get(name)
            if kind == "DELETED":
                self.pods.pop(name, None)
            else:
                state = _pod_state(pod)
                self.pods[name] = state
                if state.ip and (before is None or before.ip != state.ip):
                    address = state.ip
                    if before is not None and before.ip:
                        self.moves += 1
                        self.moved_pods.add(name)
                if before is not None and before.gate != state.gate:
                    self.gate_changes.append((at, name, state.gate, state.gate_reason))
            self.changed.notify_all()
        if address is not None and self.addressed is not None:
            self.addressed(address, name)  # outside the lock: the callee may block

    def running(self) -> int:
        return sum(1 for p in self.pods.values() if p.running)

    def gates(self, status: str) -> int:
        return sum(1 for p in self.pods.values() if p.running and p.gate == status)


@dataclass(frozen=True, slots=True)
class SyncState:
    at: float
    members: int
    generation: int | None
    version: int | None
    ready: tuple[str, str] | None  # (status, reason)


class SyncWatch(Watched):
    """The WeightSync's status as it arrives: every change, stamped."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str) -> None:
        super().__init__()
        self.history: list[SyncState] = []
        custom = client.CustomObjectsApi(api)

        def list_fn(**kwargs: Any) -> Any:
            return custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, field_selector=f"metadata.name={name}", **kwargs
            )

        def run() -> None:
            try:
                _stream(list_fn, self._event)
            except BaseException as error:
                with self.changed:
                    self.error = error
                    self.changed.notify_all()

        threading.Thread(target=run, name="watch-weightsync", daemon=True).start()

    def _event(self, kind: str, obj: dict[str, Any], at: float) -> None:
        status = obj.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
        state = SyncState(
            at=at,
            members=len(status.get("members") or []),
            generation=status.get("groupGeneration"),
            version=status.get("currentVersion"),
            ready=(ready["status"], ready["reason"]) if ready else None,
        )
        with self.changed:
            if kind != "DELETED" and (not self.history or self._differs(state)):
                self.history.append(state)
            self.changed.notify_all()

    def _differs(self, state: SyncState) -> bool:
        last = self.history[-1]
        return (last.members, last.generation, last.version, last.ready) != (
            state.members, state.generation, state.version, state.ready,
        )  # fmt: skip

    @property
    def now(self) -> SyncState | None:
        return self.history[-1] if self.history else None


@dataclass
class PassSample:
    at: float
    seconds: float  # the pass's duration (the mean when an interval held several)
    shared: bool  # several passes ended within one scrape interval


@dataclass
class OperatorSampler:
    """Scrapes the operator's metrics (`SCRAPE_SECONDS`) and reads its RSS from /proc.

    A pass's duration is the growth of the pass histogram's sum over one scrape
    interval, divided by the passes that ended in it: passes of one WeightSync never
    overlap, and at this interval almost every one ends alone in its interval (those
    that did not are flagged `shared`).
    """

    metrics_url: str
    pid: int
    passes: list[PassSample] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (at, bytes)
    scrape_seconds: float = 0.05
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, name="operator-sampler", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last: tuple[float, float] | None = None
        next_rss = 0.0
        while not self._stop.wait(self.scrape_seconds):
            now = time.monotonic()
            try:
                total, count = self._scrape()
            except OSError:
                continue  # the operator restarting: the next scrape starts over
            if last is not None and count > last[1]:
                ended = count - last[1]
                self.passes.append(PassSample(now, (total - last[0]) / ended, ended > 1))
            last = (total, count)
            if now >= next_rss:
                self.rss.append((now, rss_bytes(self.pid)))
                next_rss = now + 0.5

    def _scrape(self) -> tuple[float, float]:
        # Only the pass histogram's sum and count: rendering every metric this often
        # would cost the operator a good part of a core.
        query = f"?name[]={PASS_METRIC}_sum&name[]={PASS_METRIC}_count"
        url = self.metrics_url + query
        with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310
            text = reply.read().decode()
        total = count = 0.0
        for family in text_string_to_metric_families(text):
            if family.name != PASS_METRIC:
                continue
            for sample in family.samples:
                if sample.name == f"{PASS_METRIC}_sum":
                    total = sample.value
                elif sample.name == f"{PASS_METRIC}_count":
                    count = sample.value
        return total, count

    def passes_between(self, start: float, end: float) -> list[float]:
        return [p.seconds for p in self.passes if start <= p.at <= end]

    def peak_rss(self, start: float = 0.0, end: float = float("inf")) -> int:
        return max((b for at, b in self.rss if start <= at <= end), default=0)


def rss_bytes(pid: int) -> int:
    """The resident set of `pid` (VmRSS), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0
