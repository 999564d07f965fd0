"""A real Prometheus server (Debian's `prometheus`) for end-to-end tests.

The e2e stack has no Prometheus Operator, so the chart's ServiceMonitor and PodMonitor
cannot select targets here. Instead the caller names them (static targets), and
`operator_job` / `agent_job` label them the way those monitors do in a cluster, so the
dashboards' and alerts' queries run unchanged:

    jobs = [operator_job(["127.0.0.5:9090"]),
            agent_job([agent_target("127.0.0.7:9470", namespace="rl", pod="engine-0",
                                    weightsync="tiny")])]
    with Prometheus(tmp_path, jobs) as prometheus:
        prometheus.wait_targets_up()
        prometheus.query('weightsync_current_version{role="sink"}')
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from tests.support.eventually import eventually

READY_TIMEOUT_SECONDS = 30.0  # the server answering /-/ready after start
TARGETS_UP_TIMEOUT_SECONDS = 30.0  # every target scraped successfully at least once
STOP_TIMEOUT_SECONDS = 10.0
HTTP_TIMEOUT_SECONDS = 10.0


class PrometheusError(RuntimeError):
    """The server refused a query or did not come up."""


@dataclass(frozen=True)
class Target:
    """One scrape target and the labels it carries (as service discovery would add them)."""

    address: str  # host:port
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ScrapeJob:
    name: str
    targets: Sequence[Target]
    metrics_path: str = "/metrics"
    honor_labels: bool = False


def agent_target(address: str, *, namespace: str, pod: str, weightsync: str) -> Target:
    """An agent sidecar's metrics endpoint, labelled like the chart's PodMonitor does."""
    return Target(address, {"namespace": namespace, "pod": pod, "weightsync": weightsync})


def agent_job(targets: Sequence[Target]) -> ScrapeJob:
    """The agents: the PodMonitor adds `namespace`, `pod` and `weightsync` to every target."""
    for target in targets:
        missing = {"namespace", "pod", "weightsync"} - set(target.labels)
        if missing:
            raise ValueError(f"agent target {target.address} lacks labels {sorted(missing)}")
    return ScrapeJob("weightsync-agents", targets)


def operator_job(
    addresses: Sequence[str],
    namespace: str = "weightsync-system",
    *,
    service: str = "weightsync-metrics",
) -> ScrapeJob:
    """The operator: honorLabels, like the chart's ServiceMonitor, so per-WeightSync series
    keep their own `namespace` label; other series get the operator's. The job is named
    after the metrics Service, as a ServiceMonitor's job is (`WeightSyncOperatorDown`
    reads `up` of that job)."""
    return ScrapeJob(
        service,
        [Target(address, {"namespace": namespace}) for address in addresses],
        honor_labels=True,
    )


def scrape_config(
    jobs: Sequence[ScrapeJob],
    *,
    scrape_interval: str = "1s",
    rule_files: Sequence[Path] = (),
) -> dict[str, Any]:
    """Prometheus's configuration for static targets; one target group per target."""
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names must be unique: {names}")
    return {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": scrape_interval,
        },
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {
                "job_name": job.name,
                "metrics_path": job.metrics_path,
                "honor_labels": job.honor_labels,
                "static_configs": [
                    {"targets": [target.address], "labels": dict(target.labels)}
                    for target in job.targets
                ],
            }
            for job in jobs
        ],
    }


def prometheus_binary() -> Path:
    found = shutil.which("prometheus")
    if found is None:
        raise PrometheusError("no `prometheus` on PATH (Debian: apt-get install prometheus)")
    return Path(found)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Prometheus:
    """A Prometheus server on 127.0.0.1 with its own config and TSDB under `workdir`."""

    def __init__(
        self,
        workdir: Path,
        jobs: Sequence[ScrapeJob],
        *,
        scrape_interval: str = "1s",
        rule_files: Sequence[Path] = (),
        port: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.config_file = workdir / "prometheus.yml"
        self.log_file = workdir / "prometheus.log"
        self.config = scrape_config(jobs, scrape_interval=scrape_interval, rule_files=rule_files)
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.expected_targets = sum(len(job.targets) for job in jobs)
        self._process: subprocess.Popen[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
        argv = [
            str(prometheus_binary()),
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with self.log_file.open("ab") as log:
            self._process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            eventually(
                self._ready,
                timeout=READY_TIMEOUT_SECONDS,
                interval=0.2,
                message=f"prometheus on {self.url} ready",
            )
        except AssertionError as error:
            self.stop()
            raise PrometheusError(f"{error}\n{self.log_tail()}") from None
        return self

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (a caller may outlive this object)."""
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def _ready(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            raise PrometheusError(f"prometheus exited with {self._process.returncode}")
        try:
            with urllib.request.urlopen(  # noqa: S310 - http to our own 127.0.0.1 server
                f"{self.url}/-/ready", timeout=HTTP_TIMEOUT_SECONDS
            ) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    # -- HTTP API --------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a successful answer."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_SECONDS) as reply:  # noqa: S310
                body = json.load(reply)
        except urllib.error.HTTPError as error:
            body = json.loads(error.read() or b"{}")
            raise PrometheusError(f"{path} {params}: {body.get('error', error)}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('error', body)}")
        return body["data"]

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return active

    def wait_targets_up(self, timeout: float = TARGETS_UP_TIMEOUT_SECONDS) -> list[dict[str, Any]]:
        """Wait until every configured target has been scraped successfully."""

        def all_up() -> list[dict[str, Any]] | None:
            active = self.targets()
            if len(active) == self.expected_targets and all(t["health"] == "up" for t in active):
                return active
            return None

        try:
            return eventually(all_up, timeout=timeout, interval=0.5, message="targets up")
        except AssertionError:
            down = [
                f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}" for t in self.targets()
            ]
            raise PrometheusError("targets not up:\n" + "\n".join(down)) from None

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (a vector: [{"metric": {...}, "value": [t, "v"]}])."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's result (a matrix: [{"metric": {...}, "values": [[t, "v"], ...]}])."""
        data = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step}"
        )
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_for(
        self,
        expr: str,
        predicate: Callable[[list[dict[str, Any]]], bool],
        timeout: float,
        message: str = "",
    ) -> list[dict[str, Any]]:
        """Poll an instant query until `predicate(result)` holds; return that result."""

        def check() -> list[dict[str, Any]] | None:
            result = self.query(expr)
            return result if predicate(result) else None

        return eventually(check, timeout=timeout, interval=0.5, message=message or expr)


def scalar_values(result: Sequence[Mapping[str, Any]]) -> dict[tuple[tuple[str, str], ...], float]:
    """An instant vector as {sorted label pairs: value}."""
    return {tuple(sorted(sample["metric"].items())): float(sample["value"][1]) for sample in result}


def scalar_values_by(result: Sequence[Mapping[str, Any]], label: str) -> dict[str, float]:
    """An instant vector as {value of `label`: value}."""
    return {str(sample["metric"].get(label)): float(sample["value"][1]) for sample in result}
