"""`make demo`: the whole product on this machine, no GPU and no Docker needed.

    python -m tests.e2e.demo [--rounds 12] [--kill-at 5]   # what `make demo` runs
    python -m tests.e2e.demo down                          # what `make demo-down` runs

It builds (or reuses) the local control plane and its real node (kubelet, containerd),
builds weightsync's images from `images/` and imports them into the node, `helm
install`s the chart as a user would, applies `docs/examples/demo/` (a trainer
StatefulSet and two reference-engine Deployments behind Services) and the WeightSync,
then asks the trainer for one optimizer step + publish at a time. Half-way one engine
pod fails (deleted at once, as a lost node would): the Deployment replaces it, the new
agent pulls the current version from the trainer agent's host copy, and only then does
the pod turn Ready and join its Service's endpoints. At the end it checks every engine
is bit-identical to the trainer and prints a summary with latencies from Prometheus.
Everything keeps running for you to look at until `make demo-down`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.cluster import images
from tests.cluster.controlplane import CACHE_DIR, REPO_ROOT, LocalCluster, build_binaries
from tests.e2e import prometheus as prom
from tests.support.eventually import eventually

DEMO_DIR = CACHE_DIR / "clusters" / "demo"
EXAMPLES = REPO_ROOT / "docs" / "examples" / "demo"
CHART = REPO_ROOT / "charts" / "weightsync"
NAMESPACE = "rl-demo"
SYSTEM_NAMESPACE = "weightsync-system"
WEIGHTSYNC = "demo"
GATE = "weightsync.io/weights-current"

# How long each phase may take on a 2-core machine where every pod imports torch.
OPERATOR_UP_SECONDS = 180.0
OPERATOR_METRICS_PORT = 9090  # the chart's operator.metricsPort
AGENT_METRICS_PORT = 9470  # the chart's agent.metricsPort
STACK_WARM_SECONDS = 300.0
ROUND_SECONDS = 120.0
SETTLE_ROUNDS = 60  # extra steps, at most, until the replacement is back and in sync
SETTLE_PAUSE_SECONDS = 2.0
# The node's copy of the images and its containers: 14 GB at the demo's peak (measured
# 2026-11-25). Short of that, kubelets stop starting containers and every later step
# times out waiting for pods: refuse up front instead.
NODE_DISK_BYTES = 16 << 30


class DemoError(RuntimeError):
    pass


class Console:
    """Progress lines with the time since the demo started; quiet in tests."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.started = time.monotonic()
        self.quiet = quiet
        self.steps: list[tuple[str, float]] = []  # (step, seconds) for the summary

    def say(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    @contextmanager
    def step(self, message: str, *, slow_hint: str = "") -> Iterator[None]:
        """A step that may take long: a ticker shows it is still moving."""
        self.say(f"{message} ...")
        began = time.monotonic()
        done = threading.Event()

        def tick() -> None:
            while not done.wait(30):
                self.say(f"  still {message.lower()} ({time.monotonic() - began:.0f}s){slow_hint}")

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
        seconds = time.monotonic() - began
        self.steps.append((message, seconds))
        self.say(f"{message}: done in {seconds:.1f}s")


@dataclass
class RoundRow:
    version: int
    ok: bool
    reason: str
    millis: int
    bytes: int
    generation: int | None


@dataclass
class DemoResult:
    rounds: list[RoundRow] = field(default_factory=list)
    versions: dict[str, int | None] = field(default_factory=dict)  # engine pod -> version
    identical: dict[str, bool] = field(default_factory=dict)  # engine pod -> bit-identical
    killed_pod: str = ""
    replacement_pod: str = ""
    recovery_seconds: float = 0.0
    ready_at_stale_version: list[str] = field(default_factory=list)
    endpoints_while_recovering: list[str] = field(default_factory=list)
    images: dict[str, images.ImageInfo] = field(default_factory=dict)
    latency_quantiles_ms: dict[str, float] = field(default_factory=dict)  # as drawn

    def own_quantiles_ms(self) -> dict[str, int]:
        """p50 and p99 of the rounds themselves (those an agent timed), by nearest rank."""
        timed = [r.millis for r in self.rounds if r.millis > 0]
        return {"p50": _nearest_rank(timed, 0.5), "p99": _nearest_rank(timed, 0.99)}

    prometheus_url: str = ""
    panels_with_data: list[str] = field(default_factory=list)
    panels_without_data: list[str] = field(default_factory=list)
    alerts_evaluated: dict[str, int] = field(default_factory=dict)  # alert -> series returned
    dashboard_png: Path | None = None
    setup_times: list[tuple[str, float]] = field(default_factory=list)  # .ci/setup's steps
    # The WeightSync's Ready condition once every engine serves: (status, reason, message)
    ready: tuple[str, str, str] = ("", "", "")


def _http(method: str, url: str, timeout: float = 120.0) -> Any:
    request = urllib.request.Request(url, method=method)  # noqa: S310 - pod IPs we created
    with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310
        return json.loads(reply.read())


class Demo:
    def __init__(
        self,
        state_dir: Path,
        console: Console,
        *,
        keep_images: bool = True,
        images_dir: Path | None = None,
    ) -> None:
        self.console = console
        # The demo's stable state dir keeps the node's imported images across `down`: a
        # warm demo imports nothing.
        self.cluster = LocalCluster(
            state_dir=state_dir,
            nodes=0,
            real_node=True,
            keep_images=keep_images,
            images_dir=images_dir,
        )
        self.prometheus: prom.Prometheus | None = None

    # -- kubectl helpers -----------------------------------------------------------

    def get(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl("get", *args, "-o", "json").stdout)

    def pods(self, label: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("pods", "-n", NAMESPACE, "-l", label)["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def weightsync(self) -> dict[str, Any]:
        result: dict[str, Any] = self.get("weightsync", WEIGHTSYNC, "-n", NAMESPACE)
        return result

    # -- phases --------------------------------------------------------------------

    def start_cluster(self, result: DemoResult) -> None:
        with self.console.step(
            "Building the control plane and node (etcd, kube-apiserver, kubelet, helm)",
            slow_hint="; the first run compiles Kubernetes from source, about 10 minutes",
        ):
            self.cluster.bin_dir = build_binaries()
        self.check_disk()
        with self.console.step("Starting the local control plane and its node"):
            self.cluster.up()
        self.console.say(f"KUBECONFIG={self.cluster.kubeconfig}")
        with self.console.step(
            "Building weightsync's images (images/) and importing them into the node",
            slow_hint="; the first run downloads torch's wheels and builds, about 8 minutes",
        ):
            result.images = images.ensure_images(self.cluster.node.containerd_address)

    def check_disk(self) -> None:
        """Refuse to start a node that cannot hold its images (see NODE_DISK_BYTES)."""
        where = next(
            p for p in (self.cluster.state_dir, *self.cluster.state_dir.parents) if p.exists()
        )
        free = shutil.disk_usage(where).free
        kept = self.cluster.node.containerd_root  # a kept node imports little
        if free < NODE_DISK_BYTES and not kept.exists():
            raise DemoError(
                f"{free / 2**30:.1f} GiB free under {where}; the demo's node needs about"
                f" {NODE_DISK_BYTES >> 30} GiB for its images and containers (a demo left"
                f" by `make demo` keeps its node's images in {DEMO_DIR} after `make"
                " demo-down`: remove that folder once it is down)"
            )

    def install_chart(self) -> None:
        helm = str(self.cluster.bin_dir / "helm")
        with self.console.step("helm install weightsync (operator, CRDs, webhook, dashboards)"):
            installed = subprocess.run(
                [
                    helm, "upgrade", "--install", "weightsync", str(CHART),
                    "--namespace", SYSTEM_NAMESPACE, "--create-namespace",
                    "--kubeconfig", str(self.cluster.kubeconfig),
                    # The images were imported into the node: nothing is ever pulled.
                    "--set", "image.pullPolicy=Never",
                    "--set", "agent.image.pullPolicy=Never",
                    # One 2-core node runs every pod: requests sized to fit.
                    "--set", "agent.resources.requests.cpu=50m",
                    "--set", "agent.resources.requests.memory=128Mi",
                    "--set", "resources.requests.cpu=50m",
                    "--set", "operator.resyncSeconds=1",
                    "--wait", "--timeout", f"{int(OPERATOR_UP_SECONDS)}s",
                ],
                check=False, capture_output=True, text=True, timeout=OPERATOR_UP_SECONDS + 30,
            )  # fmt: skip
            if installed.returncode != 0:
                detail = f"{installed.stderr.strip()}\n{self.system_state()}"
                raise DemoError(f"helm install failed: {detail}")
            eventually(
                self._webhook_registered,
                timeout=OPERATOR_UP_SECONDS,
                interval=1,
                message="the operator registered its webhooks",
            )

    def system_state(self) -> str:
        """The release namespace's pods and events and the node's condition: what a failed
        install is read from."""
        parts = []
        for args in (
            ("get", "pods", "-n", SYSTEM_NAMESPACE, "-o", "wide"),
            ("describe", "pods", "-n", SYSTEM_NAMESPACE),
            ("get", "events", "-n", SYSTEM_NAMESPACE, "--sort-by=.lastTimestamp"),
            ("describe", "nodes"),
        ):
            result = self.cluster.kubectl(*args, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{result.stdout}{result.stderr}")
        return "\n".join(parts)

    def operator_may(self, verb: str, resource: str, namespace: str) -> bool:
        """`kubectl auth can-i` as the operator's ServiceAccount."""
        account = f"system:serviceaccount:{SYSTEM_NAMESPACE}:weightsync"
        result = self.cluster.kubectl(
            "auth", "can-i", verb, resource, "-n", namespace, "--as", account, check=False
        )
        return result.stdout.strip() == "yes"

    def helm_test(self) -> subprocess.CompletedProcess[str]:
        """`helm test --logs` on the live release (the chart's webhook check)."""
        helm = str(self.cluster.bin_dir / "helm")
        return subprocess.run(
            [helm, "test", "weightsync", "--namespace", SYSTEM_NAMESPACE, "--logs",
             "--timeout", "180s", "--kubeconfig", str(self.cluster.kubeconfig)],
            check=False, capture_output=True, text=True, timeout=240,
        )  # fmt: skip

    def test_pods(self) -> list[str]:
        """The chart's test pods in the release namespace, as `pod/<name>`."""
        return self.cluster.kubectl(
            "get", "pods", "-n", SYSTEM_NAMESPACE, "-l", "app.kubernetes.io/component=test",
            "-o", "name",
        ).stdout.split()  # fmt: skip

    def uninstall_chart(self) -> float:
        """`helm uninstall`, then what a user does next: apply and delete a WeightSync and
        delete the CRD. Seconds those took; raises if the cluster refuses or hangs."""
        helm = str(self.cluster.bin_dir / "helm")
        subprocess.run(
            [helm, "uninstall", "weightsync", "--namespace", SYSTEM_NAMESPACE, "--wait",
             "--timeout", "240s", "--kubeconfig", str(self.cluster.kubeconfig)],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        started = time.monotonic()
        other = (
            (EXAMPLES / "weightsync.yaml")
            .read_text()
            .replace(f"name: {WEIGHTSYNC}\n", "name: after-uninstall\n", 1)
        )
        self.cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=other)
        for name in ("after-uninstall", WEIGHTSYNC):
            self.cluster.kubectl("delete", "weightsync", name, "-n", NAMESPACE, "--timeout=30s")
        self.cluster.kubectl("delete", "crd", "weightsyncs.weightsync.io", "--timeout=30s")
        return time.monotonic() - started

    def _webhook_registered(self) -> bool:
        result = self.cluster.kubectl("get", "mutatingwebhookconfigurations", "-o", "json")
        return any(item.get("webhooks") for item in json.loads(result.stdout)["items"])

    def apply_workloads(self) -> None:
        with self.console.step("Applying the trainer, two engine Deployments and the WeightSync"):
            self.cluster.kubectl("create", "namespace", NAMESPACE, check=False)
            eventually(
                lambda: (
                    self.cluster.kubectl(
                        "get", "serviceaccount", "default", "-n", NAMESPACE, check=False
                    ).returncode
                    == 0
                ),
                timeout=30,
                message="default ServiceAccount",
            )
            for name in ("weightsync.yaml", "trainer.yaml", "engines.yaml"):
                self.cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLES / name))
        with self.console.step("Waiting for pods, sidecars and the pre-warmed group"):
            eventually(self._warm, timeout=STACK_WARM_SECONDS, interval=1, message="group warm")
        status = self.weightsync()["status"]
        self.console.say(
            f"group generation {status.get('groupGeneration')}: "
            f"{len(status.get('members', []))} members, Prewarmed=True"
        )

    def _warm(self) -> bool:
        status = self.weightsync().get("status", {})
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        members = status.get("members", [])
        return conditions.get("Prewarmed") == "True" and len(members) == 4  # 2 ranks, 2 engines

    def trainer_url(self) -> str:
        (pod,) = self.pods("statefulset.kubernetes.io/pod-name=trainer-0")  # rank 0 steps
        return f"http://{pod['status']['podIP']}:8080"

    def step(self) -> RoundRow:
        report = _http("POST", f"{self.trainer_url()}/step", timeout=ROUND_SECONDS)
        return RoundRow(
            version=report["version"],
            ok=report["ok"],
            reason=report.get("reason", ""),
            millis=int(report.get("duration_seconds", 0) * 1000),
            bytes=report.get("bytes", 0),
            generation=report.get("generation"),
        )

    def fail_engine_pod(self, deployment: str) -> tuple[str, int]:
        """Delete `deployment`'s pod at once (grace 0), as a lost node would."""
        (pod,) = self.pods(f"app={deployment}")
        name = pod["metadata"]["name"]
        self.cluster.kubectl(
            "delete", "pod", name, "-n", NAMESPACE, "--grace-period=0", "--force", "--wait=false"
        )
        version = self.weightsync()["status"].get("currentVersion", 0)
        return name, version

    def endpoints(self, service: str) -> list[str]:
        """The pod IPs a Service's EndpointSlices list as ready."""
        slices = self.get(
            "endpointslices", "-n", NAMESPACE, "-l", f"kubernetes.io/service-name={service}"
        )
        return [
            address
            for item in slices["items"]
            for endpoint in item.get("endpoints") or []
            if (endpoint.get("conditions") or {}).get("ready")
            for address in endpoint["addresses"]
        ]

    def replacement_ready(self, deployment: str, old_pod: str, result: DemoResult) -> bool:
        """Whether `old_pod`'s replacement is Ready; notes it if Ready at a stale version."""
        # Endpoints first, then pods: a recovering pod only ever turns Ready, so one listed
        # as ready before its pod reads NotReady was listed while it was behind.
        listed = self.endpoints(deployment)
        for pod in self.pods(f"app={deployment}"):
            name = pod["metadata"]["name"]
            if name == old_pod or pod["status"].get("phase") != "Running":
                continue
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            if conditions.get("Ready") != "True":
                # Recovering: its Service must not send it a request yet.
                if pod["status"].get("podIP") in listed:
                    result.endpoints_while_recovering.append(name)
                continue
            version = self.engine_version(pod)
            current = self.weightsync()["status"].get("currentVersion")
            # The WeightSync's status may lag a round behind the engines; only behind is stale.
            if version is None or (current is not None and version < current):
                result.ready_at_stale_version.append(f"{name}@{version}<{current}")
            result.replacement_pod = name
            return True
        return False

    def engine_version(self, pod: dict[str, Any]) -> int | None:
        health = _http("GET", f"http://{pod['status']['podIP']}:8000/health", timeout=10)
        version: int | None = health.get("version")
        return version

    def verify(self, result: DemoResult) -> None:
        trainer = _http("GET", f"{self.trainer_url()}/digest")
        for deployment in ("engine-a", "engine-b"):
            for pod in self.pods(f"app={deployment}"):
                if pod["status"].get("phase") != "Running":
                    continue
                name = pod["metadata"]["name"]
                digest = _http("GET", f"http://{pod['status']['podIP']}:8000/v1/weights/digest")
                result.versions[name] = digest["version"]
                result.identical[name] = (
                    digest["version"] == trainer["version"]
                    and digest["tensors"] == trainer["tensors"]
                )

    def stop_prometheus(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None

    def close(self) -> None:
        """Stop everything this demo started (what `make demo-down` does from outside)."""
        self.stop_prometheus()
        self.cluster.down()

    def scrape_jobs(self) -> list[prom.ScrapeJob]:
        """The operator and every running agent, labelled as the chart's monitors would."""
        operator_pods = self.get("pods", "-n", SYSTEM_NAMESPACE)["items"]
        operators = [
            f"{p['status']['podIP']}:{OPERATOR_METRICS_PORT}"
            for p in operator_pods
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
        ]
        agents = [
            prom.agent_target(
                f"{p['status']['podIP']}:{AGENT_METRICS_PORT}",
                namespace=NAMESPACE,
                pod=p["metadata"]["name"],
                weightsync=WEIGHTSYNC,
            )
            for p in self.get("pods", "-n", NAMESPACE)["items"]
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
        ]
        return [prom.operator_job(operators, SYSTEM_NAMESPACE), prom.agent_job(agents)]

    def start_prometheus(self) -> prom.Prometheus:
        server = prom.Prometheus(self.cluster.state_dir / "prometheus", self.scrape_jobs()).start()
        if server.pid is not None:  # `down` stops it with the rest of the demo
            (self.cluster.pid_dir / "prometheus.pid").write_text(str(server.pid))
        server.wait_targets_up()
        self.prometheus = server
        return server

    def retarget_prometheus(self) -> None:
        """Scrape the pods running now (a replaced pod has a new IP): rewrite and reload."""
        server = self.prometheus
        if server is None or server.pid is None:
            return
        jobs = self.scrape_jobs()
        server.config = prom.scrape_config(jobs, scrape_interval="1s")
        server.expected_targets = sum(len(job.targets) for job in jobs)
        server.config_file.write_text(yaml.safe_dump(server.config, sort_keys=False))
        os.kill(server.pid, signal.SIGHUP)
        server.wait_targets_up()

    def wait_ready_condition(self, timeout: float = 30.0) -> tuple[str, str, str]:
        """The WeightSync's Ready condition, once True (or as it is after `timeout`): the
        operator's next passes see the replacement in the group."""
        deadline = time.monotonic() + timeout
        while True:
            conditions = (self.weightsync().get("status") or {}).get("conditions") or []
            ready = next((c for c in conditions if c["type"] == "Ready"), {})
            found = (ready.get("status", ""), ready.get("reason", ""), ready.get("message", ""))
            if found[0] == "True" or time.monotonic() > deadline:
                return found
            time.sleep(1.0)

    def observe(self, result: DemoResult, since: float) -> None:
        """Every dashboard panel and alert against Prometheus, and the dashboard as a PNG."""
        server = self.prometheus
        if server is None:
            raise DemoError("Prometheus is not running")
        dashboards = _dashboard_script()
        dashboard = json.loads(dashboards.DASHBOARD.read_text())
        end, step = time.time(), 2.0
        # Evaluated at start, start + step, ...: a grid that ends at `end` itself, so the
        # last point sees the scrape the caller waited for (a grid ending up to a step
        # earlier missed the replacement pod's first samples).
        start = end - step * math.ceil((end - since) / step)
        recording = dashboards.record(
            dashboard,
            server.url,
            start=start,
            end=end,
            step=step,
            variables={"namespace": NAMESPACE, "weightsync": WEIGHTSYNC},
        )
        for title, targets in recording["panels"].items():
            has_data = any(target["result"] for target in targets.values())
            (result.panels_with_data if has_data else result.panels_without_data).append(title)
        recorded = self.cluster.state_dir / "dashboard_recording.json"
        recorded.write_text(json.dumps(recording, indent=1))  # docs and tests redraw it
        result.dashboard_png = dashboards.render(
            recording, dashboard, self.cluster.state_dir / "dashboard.png"
        )
        for alert, expr in _alert_expressions(self.cluster.bin_dir / "helm").items():
            result.alerts_evaluated[alert] = len(server.query(expr))

    def quantiles(self, server: prom.Prometheus, rounds: int) -> dict[str, float]:
        """Round latency p50 and p99 as the dashboard draws them, from rank 0's agent: the
        one whose rounds the demo lists, so both figures come from the same rounds."""
        rank0 = 'role="source", pod="trainer-0"'
        server.wait_for(  # every round the demo ran is in the scraped histogram
            f"sum(weightsync_round_duration_seconds_count{{{rank0}}})",
            lambda found: bool(found) and float(found[0]["value"][1]) >= rounds,
            timeout=30,
            message=f"rank 0's agent's histogram holds {rounds} rounds",
        )
        found: dict[str, float] = {}
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            expr = (
                f"histogram_quantile({q}, sum by (le) "
                f"(weightsync_round_duration_seconds_bucket{{{rank0}}}))"
            )
            result = server.wait_for(expr, bool, timeout=30)
            found[name] = float(result[0]["value"][1]) * 1000
        return found


def _dashboard_script() -> Any:
    """docs/scripts/render_dashboard.py, the project's own dashboard renderer."""
    path = REPO_ROOT / "docs" / "scripts" / "render_dashboard.py"
    spec = importlib.util.spec_from_file_location("render_dashboard", path)
    if spec is None or spec.loader is None:
        raise DemoError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _alert_expressions(helm: Path) -> dict[str, str]:
    """The chart's alert rules, as `helm template` renders them where monitors exist."""
    rendered = subprocess.run(
        [str(helm), "template", "weightsync", str(CHART), "--namespace", SYSTEM_NAMESPACE,
         "--api-versions", "monitoring.coreos.com/v1"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    for item in yaml.safe_load_all(rendered):
        if item and item.get("kind") == "PrometheusRule":
            return {
                rule["alert"]: rule["expr"]
                for group in item["spec"]["groups"]
                for rule in group["rules"]
                if "alert" in rule
            }
    raise DemoError("the chart rendered no PrometheusRule")


def run(demo: Demo, *, rounds: int, kill_at: int, setup_times: Path | None = None) -> DemoResult:
    """The scenario; everything it starts keeps running until `demo.close()` or `down`."""
    if not 1 <= kill_at < rounds:
        raise DemoError(f"--kill-at must be between 1 and {rounds - 1}")
    console = demo.console
    result = DemoResult(setup_times=read_setup_times(setup_times))
    demo.start_cluster(result)
    demo.install_chart()
    demo.apply_workloads()
    with console.step("Starting Prometheus (scraping the operator and every agent)"):
        demo.start_prometheus()
    watching_since = time.time()
    console.say("round  version  ok  reason            duration  bytes      generation")
    killed_at = 0.0
    for index in range(1, rounds + 1):
        _print_round(console, index, demo.step(), result)
        if index == kill_at:
            result.killed_pod, version = demo.fail_engine_pod("engine-b")
            killed_at = time.monotonic()
            console.say(f"engine pod {result.killed_pod} failed at version {version}")
        elif killed_at and not result.replacement_pod:
            _note_recovery(demo, result, killed_at, console)

    def all_identical() -> bool:
        demo.verify(result)
        return len(result.identical) == 2 and all(result.identical.values())

    # A trainer keeps training: until the replacement has recovered (it may recover an
    # older held version and catch up in the next round) and a round has reached every
    # engine, the demo keeps stepping, a little slower.
    settle = 0
    while not (
        (result.replacement_pod or _note_recovery(demo, result, killed_at, console))
        and result.rounds[-1].ok
        and all_identical()
    ):
        if settle == SETTLE_ROUNDS:
            raise DemoError(f"engines did not converge in {SETTLE_ROUNDS} more rounds: {result}")
        settle += 1
        time.sleep(SETTLE_PAUSE_SECONDS)
        _print_round(console, len(result.rounds) + 1, demo.step(), result)
    console.say("every engine serves the trainer's latest version, bit-identical")
    result.ready = demo.wait_ready_condition()
    console.say(f"kubectl get wsync: READY {result.ready[0]} ({result.ready[1]})")
    with console.step("Reading round latencies, every dashboard panel and alert from Prometheus"):
        demo.retarget_prometheus()  # the replacement pod has an IP of its own
        server = demo.prometheus
        if server is None:
            raise DemoError("Prometheus is not running")
        final = result.rounds[-1].version
        server.wait_for(  # Prometheus has scraped the final state of every engine
            'weightsync_current_version{role="sink"}',
            lambda found: all(
                prom.scalar_values_by(found, "pod").get(pod) == final for pod in result.versions
            ),
            timeout=30,
            message=f"every engine's scraped version is {final}",
        )
        result.latency_quantiles_ms = demo.quantiles(
            server, len([r for r in result.rounds if r.millis > 0])
        )
        result.prometheus_url = server.url
        demo.observe(result, watching_since)
    _summary(result, demo, console)
    return result


def _print_round(console: Console, index: int, row: RoundRow, result: DemoResult) -> None:
    result.rounds.append(row)
    console.say(
        f"{index:5d}  {row.version:7d}  {'yes' if row.ok else 'NO ':3s} {row.reason:17s} "
        f"{row.millis:6d} ms  {row.bytes:9d}  {row.generation}"
    )


def _note_recovery(demo: Demo, result: DemoResult, killed_at: float, console: Console) -> bool:
    if not demo.replacement_ready("engine-b", result.killed_pod, result):
        return False
    result.recovery_seconds = time.monotonic() - killed_at
    demo.retarget_prometheus()  # scrape the replacement's agent from now on
    console.say(
        f"{result.replacement_pod} replaced {result.killed_pod}: recovered from the trainer's "
        f"host copy and Ready {result.recovery_seconds:.1f}s after the kill"
    )
    return True


def _nearest_rank(values: list[int], q: float) -> int:
    """The `q` quantile of `values` by nearest rank: what the histogram approximates
    (it observes every round, failed ones too)."""
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def read_setup_times(path: Path | None) -> list[tuple[str, float]]:
    """The steps `.ci/setup` timed on this run (`WEIGHTSYNC_SETUP_TIMES`): one
    "step<TAB>seconds" line each; none when the demo was started without it."""
    if path is None or not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        name, _, seconds = line.rpartition("\t")
        if name:
            steps.append((name, float(seconds)))
    return steps


def _summary(result: DemoResult, demo: Demo, console: Console) -> None:
    ok = [r for r in result.rounds if r.ok]
    total_bytes = sum(r.bytes for r in ok)
    own = result.own_quantiles_ms()
    lines = [
        "",
        "weightsync demo summary",
        f"  rounds                 {len(ok)} of {len(result.rounds)} committed",
        f"  round latency (Prom.)  p50 {result.latency_quantiles_ms.get('p50', 0):.0f} ms, "
        f"p99 {result.latency_quantiles_ms.get('p99', 0):.0f} ms (the rounds themselves: "
        f"p50 {own['p50']} ms, p99 {own['p99']} ms)",
        f"  bytes per round        {ok[-1].bytes if ok else 0} ({total_bytes} in all)",
        f"  failed / recovered     {result.killed_pod} -> {result.replacement_pod} "
        f"in {result.recovery_seconds:.1f}s (in its Service's endpoints while behind: "
        f"{', '.join(result.endpoints_while_recovering) or 'never'})",
        "  images                 "
        + ", ".join(
            f"{info.ref} ({info.size_bytes / 1e9:.2f} GB)" for info in result.images.values()
        ),
        "  time on this run       (.ci/setup's steps, then the demo's)",
        *(
            f"    {name.split(' (')[0][:62]:62s} {seconds:6.1f} s"
            for name, seconds in [
                *(("setup: " + n, t) for n, t in result.setup_times),
                *console.steps,
            ]
        ),
        "  engine pods            version  bit-identical to trainer",
    ]
    for pod, version in sorted(result.versions.items()):
        lines.append(f"    {pod:36s} {version!s:7s}  {result.identical.get(pod)}")
    lines += [
        "",
        f"  kubectl:    export KUBECONFIG={demo.cluster.kubeconfig}; "
        f"kubectl get wsync -n {NAMESPACE}",
        f"  Prometheus: {result.prometheus_url}  (weightsync_round_duration_seconds, ...)",
        f"  dashboard:  {result.dashboard_png}  ({len(result.panels_with_data)} panels with"
        f" data; none yet: {', '.join(result.panels_without_data) or '-'})",
        f"  alerts:     {len(result.alerts_evaluated)} rules evaluated, "
        f"{sum(1 for n in result.alerts_evaluated.values() if n)} firing",
        f"  logs:       {demo.cluster.state_dir}/logs, {demo.cluster.node.pod_logs}",
        "  stop:       make demo-down",
    ]
    for line in lines:
        console.say(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("command", nargs="?", choices=["run", "down"], default="run")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--state-dir", type=Path, default=DEMO_DIR)
    parser.add_argument(
        "--setup-times", type=Path, help="the step times .ci/setup wrote on this run"
    )
    args = parser.parse_args(argv)
    if args.command == "down":
        Demo(args.state_dir, Console()).close()  # keeps the imported images
        print("demo stopped")
        return 0
    result = run(
        Demo(args.state_dir, Console()),
        rounds=args.rounds,
        kill_at=args.kill_at,
        setup_times=args.setup_times,
    )
    healthy = (
        all(result.identical.values())
        and not result.ready_at_stale_version
        and not result.endpoints_while_recovering
    )
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
