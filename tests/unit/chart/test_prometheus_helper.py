"""tests/e2e/prometheus.py: the scrape config it writes, and one short real run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import start_http_server

from tests.e2e.prometheus import (
    Prometheus,
    PrometheusError,
    ScrapeJob,
    Target,
    agent_job,
    agent_target,
    operator_job,
    scalar_values,
    scrape_config,
)
from tests.unit.chart.helm import MONITORING_API, one, render


def engine(index: int, port: int = 9470) -> Target:
    return agent_target(
        f"127.0.0.{10 + index}:{port}", namespace="rl", pod=f"engine-{index}", weightsync="tiny"
    )


def test_scrape_config_has_one_job_per_kind_and_one_group_per_target() -> None:
    config = scrape_config(
        [agent_job([engine(0), engine(1)]), operator_job(["127.0.0.5:9090"])],
        scrape_interval="2s",
    )
    assert config["global"] == {
        "scrape_interval": "2s",
        "scrape_timeout": "2s",
        "evaluation_interval": "2s",
    }
    agents, operator = config["scrape_configs"]
    assert agents["job_name"] == "weightsync-agents"
    assert agents["honor_labels"] is False
    labels = {"namespace": "rl", "weightsync": "tiny"}
    assert agents["static_configs"] == [
        {"targets": ["127.0.0.10:9470"], "labels": {**labels, "pod": "engine-0"}},
        {"targets": ["127.0.0.11:9470"], "labels": {**labels, "pod": "engine-1"}},
    ]
    assert operator["honor_labels"] is True
    assert operator["static_configs"] == [
        {"targets": ["127.0.0.5:9090"], "labels": {"namespace": "weightsync-system"}}
    ]


def test_promtool_accepts_the_generated_config(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": []}))
    config = scrape_config(
        [agent_job([engine(0)]), operator_job(["127.0.0.5:9090"])], rule_files=[rules]
    )
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package (make setup)"
    result = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_jobs_label_targets_the_way_the_charts_monitors_do() -> None:
    objects = render(api_versions=(MONITORING_API,))
    pod_monitor = one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    # The Prometheus Operator adds namespace and pod; the PodMonitor's relabeling the rest.
    relabelings = pod_monitor["relabelings"]
    monitor_labels = {"namespace", "pod"} | {
        r["targetLabel"] for r in relabelings if "targetLabel" in r
    }
    assert set(engine(0).labels) == monitor_labels
    service_monitor = one(objects, "ServiceMonitor")["spec"]["endpoints"][0]
    assert operator_job(["127.0.0.5:9090"]).honor_labels is service_monitor["honorLabels"]


def test_invalid_jobs_are_refused() -> None:
    with pytest.raises(ValueError, match="lacks labels"):
        agent_job([Target("127.0.0.9:9470", {"pod": "engine-0"})])
    with pytest.raises(ValueError, match="unique"):
        scrape_config([ScrapeJob("a", []), ScrapeJob("a", [])])


def test_a_real_server_scrapes_queries_and_reports_bad_queries(tmp_path: Path) -> None:
    from weightsync.agent.metrics import AgentMetrics

    metrics = AgentMetrics("sink")
    metrics.round_succeeded(0.05, 1024, version=7)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        job = agent_job([agent_target(address, namespace="rl", pod="engine-0", weightsync="tiny")])
        with Prometheus(tmp_path, [job]) as prometheus:
            (target,) = prometheus.wait_targets_up()
            assert target["labels"]["weightsync"] == "tiny"
            result = prometheus.wait_for(
                'weightsync_current_version{role="sink"}', bool, timeout=15
            )
            labels = (("__name__", "weightsync_current_version"), ("instance", address),
                      ("job", "weightsync-agents"), ("namespace", "rl"), ("pod", "engine-0"),
                      ("role", "sink"), ("weightsync", "tiny"))  # fmt: skip
            assert scalar_values(result) == {labels: 7.0}
            end = float(result[0]["value"][0])
            matrix = prometheus.query_range("weightsync_round_bytes_total", end - 5, end, 1)
            assert float(matrix[0]["values"][-1][1]) == 1024.0
            with pytest.raises(PrometheusError, match="parse error"):
                prometheus.query("sum(")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
