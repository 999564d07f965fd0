"""`make scale`: one WeightSync grown to many inference pods, and how the operator keeps up.

Real parts: the local control plane (etcd, kube-apiserver, controller-manager, scheduler),
KWOK nodes for the pods (scheduled and marked Running; nothing runs in them), and the
operator as a local process with its default settings, as the cluster tests run it
(`tests.support.operator`). The agents of all those pods are one load generator
(`tests.scale.loadgen`) that answers their real control API.

The scenario, timed from watches (pods, the WeightSync) and the operator's own metrics:

1. a WeightSync with a trainer and `--start` engines; version 1 published;
2. the engines scaled to `--pods`: when every pod is Running, and when the status shows
   every member (newcomers first recover version 1 from the trainer's stand-in);
3. steady state, a round every `--round-seconds`: reconcile pass durations;
4. a version flip both ways: the trainer publishes v with every engine behind (every
   gate must close), then every engine serves v (every gate must open);
5. the agents answer slower than the operator's poll timeout for 30 s: generations
   planned meanwhile, and how long until Ready and every gate are back;
6. scaled back in to `--start`: the operator's memory afterwards.
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Collection
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml
from kubernetes import config

from tests.cluster.controlplane import LocalCluster, build_binaries, free_port
from tests.scale.observe import OperatorSampler, PodWatch, SyncWatch, Watched
from tests.scale.report import Figures
from tests.support.eventually import Timeouts, eventually
from tests.support.operator import CRD_FILE, OperatorProcess, engines, trainer
from weightsync.controller.cluster.apiwriter import ApiWriter
from weightsync.controller.settings import OperatorSettings

NAMESPACE = "scale"
PODS_PER_NODE = 100  # KWOK nodes take 110 pods; a margin for the scheduler's spread
SLOW_SECONDS = 30.0
# Waits, each generous: the report says how long things took, these only stop a hang.
SETTLE = 120.0
SCALE_UP = 600.0
RECOVER = 300.0
ADMIN_READY = 30.0


def sync_manifest() -> dict[str, Any]:
    """The WeightSync: defaults everywhere but the engine's port and the pull protocol."""
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": "sync"},
        "spec": {
            "trainer": {"statefulSetRef": {"name": "trainer"}},
            "inference": [
                {"deploymentRef": {"name": "engine"}, "engine": "Reference", "port": 8000}
            ],
            "recovery": {"protocol": "TCP"},
        },
    }


class LoadGen:
    """The load generator as a process, and its admin API."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.admin = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "loadgen.log"
        with self.log.open("ab") as output:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "tests.scale.loadgen", "--port", str(self.port),
                 "--admin-port", self.admin.rsplit(":", 1)[1]],
                stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + ADMIN_READY
        while not self._answers():
            if time.monotonic() > deadline or self.popen.poll() is not None:
                raise RuntimeError(f"the load generator did not start: {self.log}")
            time.sleep(0.2)
        # Addresses go out in batches from a thread of their own: one request per pod,
        # sent from the watch's thread, fell seconds behind the operator's first polls.
        self._addresses: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        threading.Thread(target=self._announce, name="announce", daemon=True).start()

    def address(self, ip: str, pod: str) -> None:
        """`pod` holds `ip` now (`loadgen.LoadGenerator.at`); sent soon, with others."""
        self._addresses.put((ip, pod))

    def _announce(self) -> None:
        while True:
            batch = dict([self._addresses.get()])
            while not self._addresses.empty():
                ip, pod = self._addresses.get()
                batch[ip] = pod
            while True:
                try:
                    self.post("/addresses", batch)
                    break
                except OSError:
                    if self.popen.poll() is not None:
                        return  # stopped
                    time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            self.stats()
        except OSError:
            return False
        return True

    def post(self, path: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(  # noqa: S310 - our own admin port, http
            f"{self.admin}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=10):  # noqa: S310
            pass

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.admin}/stats", timeout=10) as reply:  # noqa: S310
            result: dict[str, Any] = json.loads(reply.read())
            return result

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(timeout=30)


def first_time(
    watched: Watched, predicate: Callable[[], float | None], timeout: float, what: str
) -> float:
    """When `predicate` first held (it returns that time, or None while it does not)."""
    found: float = watched.wait_for(predicate, timeout, what)
    return found


class Scenario:
    def __init__(self, args: Any, stack: ExitStack, workdir: Path) -> None:
        self.args = args
        nodes = math.ceil((args.pods + 1) / PODS_PER_NODE) + 1
        self.cluster = LocalCluster(
            state_dir=workdir / "cluster", bin_dir=build_binaries(), nodes=nodes
        )
        stack.callback(self.cluster.down)
        self.cluster.up()
        self.cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
        self.cluster.kubectl("wait", "--for=condition=Established", "crd/weightsyncs.weightsync.io")
        self.cluster.kubectl("create", "namespace", NAMESPACE)
        self.loadgen = LoadGen(workdir)
        stack.callback(self.loadgen.stop)
        self.operator = OperatorProcess(
            self.cluster, NAMESPACE, workdir,
            overrides={
                # The operator's defaults, as the issue's figures were taken with...
                "WEIGHTSYNC_OPERATOR_RESYNC_SECONDS": None,
                # ...but the agents are the load generator's stand-ins.
                "WEIGHTSYNC_OPERATOR_AGENT_HTTP_PORT": str(self.loadgen.port),
                # Another tree's operator (a before/after comparison), if asked for.
                "PYTHONPATH": str(args.operator_tree / "operator") if args.operator_tree else None,
            },
        )  # fmt: skip
        eventually(
            lambda: self.cluster.kubectl(
                "get", "serviceaccount", "default", "-n", NAMESPACE, check=False
            ).returncode == 0,
            timeout=Timeouts.API, message="the namespace's default ServiceAccount",
        )  # fmt: skip
        self.operator.start()
        stack.callback(self.operator.stop)
        assert self.operator.popen is not None
        api = config.new_client_from_config(str(self.cluster.kubeconfig))

        # The load generator answers each address for the pod that holds it now: KWOK gives
        # some pods a second address under load, and hands a freed one to another pod.
        self.engines = PodWatch(api, NAMESPACE, "engine", addressed=self.loadgen.address)
        self.trainers = PodWatch(api, NAMESPACE, "trainer", addressed=self.loadgen.address)
        self.sync = SyncWatch(api, NAMESPACE, "sync")
        self.sampler = OperatorSampler(
            f"http://127.0.0.1:{self.operator.metrics_port}/metrics", self.operator.popen.pid
        )
        self.sampler.start()
        stack.callback(self.sampler.stop)
        self.figures = Figures(pods=args.pods, start=args.start)
        self.version = 0

    def apply(self, *objects: dict[str, Any]) -> None:
        self.cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump_all(objects))

    def status_when(self, predicate: Callable[[Any], bool], timeout: float, what: str) -> float:
        """The arrival time of the first WeightSync status (from now on) that satisfies it."""
        seen = len(self.sync.history)

        def found() -> float | None:
            for state in self.sync.history[max(seen - 1, 0) :]:
                if predicate(state):
                    return state.at
            return None

        return first_time(self.sync, found, timeout, what)

    def gates_all(self, status: str, count: int, timeout: float) -> float:
        self.engines.wait_for(
            lambda: self.engines.gates(status) >= count, timeout, f"{count} gates {status}"
        )
        return time.monotonic()

    # -- the phases ------------------------------------------------------------------------

    def start(self) -> None:
        start = self.args.start
        self.apply(sync_manifest(), trainer(local=False), engines(replicas=start, local=False))
        pod = self.trainers.wait_for(
            lambda: next(
                (name for name, p in self.trainers.pods.items() if p.running and p.ip), None
            ),
            SETTLE, "the trainer pod Running",
        )  # fmt: skip
        self.loadgen.post("/source", {"pod": pod})
        self.publish(sinks=True)
        self.status_when(
            lambda s: s.members == start + 1 and s.ready == ("True", "AllMembersCurrent"),
            SETTLE, f"{start + 1} members, all current",
        )  # fmt: skip
        self.gates_all("True", start, SETTLE)

    def publish(self, *, sinks: bool) -> int:
        self.version += 1
        self.loadgen.post("/publish", {"version": self.version, "sinks": sinks})
        return self.version

    def scale_up(self) -> None:
        pods = self.args.pods
        began = time.monotonic()
        opened = {name for name, pod in self.engines.pods.items() if pod.gate == "True"}
        marker = len(self.engines.gate_changes)
        self.cluster.kubectl("scale", "deployment", "engine", "-n", NAMESPACE, f"--replicas={pods}")
        self.engines.wait_for(lambda: self.engines.running() >= pods, SCALE_UP, f"{pods} Running")
        running = time.monotonic()
        members = self.status_when(lambda s: s.members >= pods + 1, SCALE_UP, "every member")
        gates = self.gates_all("True", pods, SCALE_UP)
        # Wall-clock times, to read beside the operator's log.
        for what, at in (("every pod Running", running), ("every member", members)):
            print(f"[scale] {what} at {_wall(at)}", flush=True)
        self.figures.running_seconds = running - began
        self.figures.members_after_running = members - running
        self.figures.gates_after_running = gates - running
        closings = reclosings(self.engines.gate_changes[marker:], opened, self.engines.moved_pods)
        closed = Counter(reason for _, _, reason in closings)
        self.figures.reclosed_gates = closed.total()
        if closed:
            print(f"[scale] gates closed again, by reason: {dict(closed)}", flush=True)
        # The operator's own (not KWOK's re-addressed pods), to read beside its log.
        for at, pod, reason in [c for c in closings if not c[2].endswith("moved")][:10]:
            print(f"[scale]   {pod} closed at {_wall(at)}: {reason}", flush=True)
        self.figures.scale_up_from = began
        self.figures.steady_from = members

    def steady(self) -> None:
        detections = []
        for _ in range(self.args.rounds):
            flipped = time.monotonic()
            version = self.publish(sinks=True)
            seen = self.status_when(
                lambda s, v=version: s.version == v, SETTLE, f"version {version}"
            )
            detections.append(seen - flipped)
            time.sleep(max(0.0, flipped + self.args.round_seconds - time.monotonic()))
        self.figures.round_detection = detections

    def flip(self) -> None:
        pods = self.args.pods
        flipped = time.monotonic()
        marker = len(self.engines.gate_changes)
        version = self.publish(sinks=False)
        status = self.status_when(lambda s: s.version == version, SETTLE, "the flip's status")
        closed = self.gates_all("False", pods, SETTLE)
        self.figures.close = self._flip_figures(flipped, status, closed, marker)
        flipped = time.monotonic()
        marker = len(self.engines.gate_changes)
        self.loadgen.post("/load", {"version": version})
        status = self.status_when(
            lambda s: s.ready == ("True", "AllMembersCurrent"), SETTLE, "every engine current"
        )
        opened = self.gates_all("True", pods, SETTLE)
        self.figures.open = self._flip_figures(flipped, status, opened, marker)
        self.figures.steady_until = time.monotonic()

    def _flip_figures(
        self, flipped: float, status: float, last_gate: float, marker: int
    ) -> dict[str, float]:
        changes = [at for at, *_ in self.engines.gate_changes[marker:]]
        noticed = min([status, *changes[:1]])
        return {
            "noticed": noticed - flipped,  # the flip to the operator's first write about it
            "status": status - flipped,
            "reach": max(changes, default=last_gate) - noticed,  # noticed -> the last gate
            "gates": len(changes),
        }

    def floor(self) -> None:
        """What the API server allows on this machine: one status patch per engine pod
        (a probe condition no gate reads), 32 at a time, sent the way the operator
        sends its gates, timed from here. The gate flips above are measured against it."""
        names = sorted(self.engines.pods)
        writer = ApiWriter(config.new_client_from_config(str(self.cluster.kubeconfig)))
        condition = {
            "type": "weightsync.io/scale-probe", "status": "True", "reason": "Probe",
            "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z", "lastProbeTime": None,
        }  # fmt: skip

        async def patch_all() -> float:
            started = time.monotonic()
            try:
                await asyncio.gather(
                    *(writer.set_condition(NAMESPACE, n, condition) for n in names)
                )
            finally:
                await writer.close()
            return time.monotonic() - started

        self.figures.floor = {"patches": len(names), "seconds": asyncio.run(patch_all())}

    def slowdown(self) -> None:
        pods = self.args.pods
        before = self.sync.now
        planned_before = set(self.loadgen.stats()["plans"])
        timeout = OperatorSettings.model_fields["agent_timeout_seconds"].default
        began = time.monotonic()
        self.loadgen.post("/slow", {"seconds": SLOW_SECONDS, "delay": timeout + 1.0})
        healthy = began + SLOW_SECONDS
        time.sleep(SLOW_SECONDS)
        back = self.status_when(
            lambda s: s.at >= healthy and s.ready == ("True", "AllMembersCurrent")
            and s.members == pods + 1,
            RECOVER, "Ready again after the slowdown",
        )  # fmt: skip
        gates = self.gates_all("True", pods, RECOVER)
        history = [s for s in self.sync.history if s.at >= began]
        planned = sorted(set(self.loadgen.stats()["plans"]) - planned_before, key=int)
        self.figures.slow = {
            "generations": len(planned),
            "fewest_members": min((s.members for s in history), default=pods + 1),
            "ready_after": max(back, gates) - healthy,
            "generation_before": before.generation if before else None,
        }
        self.figures.slow_window = (began, max(back, gates))

    def scale_in(self) -> None:
        start = self.args.start
        self.cluster.kubectl("scale", "deployment", "engine", "-n", NAMESPACE,
                             f"--replicas={start}")  # fmt: skip
        self.status_when(lambda s: s.members == start + 1, SCALE_UP, "scaled in")
        time.sleep(10)  # memory the operator would give back, it has by now

    def collect(self) -> Figures:
        figures, sampler = self.figures, self.sampler
        figures.passes = sampler.passes_between(figures.steady_from, figures.steady_until)
        figures.shared_passes = sum(
            1 for p in sampler.passes if figures.steady_from <= p.at <= figures.steady_until
            and p.shared
        )  # fmt: skip
        figures.scale_up_passes = sampler.passes_between(figures.scale_up_from, figures.steady_from)
        start, end = figures.slow_window
        figures.slow_passes = sampler.passes_between(start, end)
        figures.rss_peak = sampler.peak_rss()
        figures.rss_after = sampler.rss[-1][1] if sampler.rss else 0
        stats = self.loadgen.stats()
        figures.plan_bytes = {int(k): v for k, v in stats["plan_bytes"].items()}
        figures.plans = {int(k): v for k, v in stats["plans"].items()}
        figures.operator_log_tracebacks = self.operator.output().count("Traceback")
        figures.moved_pods = self.engines.moves
        figures.address_waits = (
            stats["address_waits"],
            stats["unannounced"],
            stats["address_wait_max"],
        )
        return figures


def run(args: Any) -> Figures:
    with tempfile.TemporaryDirectory(prefix="weightsync-scale-") as tmp, ExitStack() as stack:
        scenario = Scenario(args, stack, Path(tmp))
        try:
            for phase in (scenario.start, scenario.scale_up, scenario.steady, scenario.flip,
                          scenario.floor, scenario.slowdown, scenario.scale_in):  # fmt: skip
                started = time.monotonic()
                print(f"[scale] {phase.__name__} ...", flush=True)
                phase()
                print(f"[scale] {phase.__name__}: {time.monotonic() - started:.1f} s", flush=True)
            return scenario.collect()
        except BaseException:
            sys.stderr.write(scenario.operator.output()[-6000:])
            raise
        finally:
            if args.output is not None:  # the logs outlive the run's directory
                for log in (scenario.operator.log, scenario.loadgen.log):
                    target = args.output.with_name(f"{args.output.stem}.{log.name}")
                    target.write_bytes(log.read_bytes() if log.exists() else b"")


def reclosings(
    changes: list[tuple[float, str, str | None, str | None]],
    opened: set[str],
    moved: Collection[str] = (),
) -> list[tuple[float, str, str]]:
    """Gates that closed after having opened (`opened`: those open at the start), as (at,
    pod, the reason they closed with), in the order `changes` (at, pod, gate status,
    reason) saw them: a pod's first condition is no flap. Pods in `moved` (KWOK gave them
    a second address, which no real pod gets) have their reason marked "moved"."""
    closings = []
    for at, pod, status, reason in changes:
        if status == "True":
            opened.add(pod)
        elif pod in opened:
            opened.discard(pod)
            closings.append((at, pod, f"{reason or 'none'}{', moved' if pod in moved else ''}"))
    return closings


def _wall(monotonic: float) -> str:
    """A `time.monotonic()` instant as the operator's log writes times."""
    at = time.time() - (time.monotonic() - monotonic)
    return time.strftime("%H:%M:%S", time.localtime(at)) + f",{int(at % 1 * 1000):03d}"
