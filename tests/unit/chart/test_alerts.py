"""The PrometheusRule's alerts, evaluated by Prometheus's own rule tester (promtool)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.chart.exported import exported
from tests.unit.chart.helm import MONITORING_API, one, render
from tests.unit.chart.promql import metric_names

ALERTS = (
    "WeightSyncSyncStalled",
    "WeightSyncVersionLag",
    "WeightSyncRecoveryFailing",
    "WeightSyncPrewarmSlow",
)


def rule_groups(values: dict[str, str] | None = None) -> list[dict[str, Any]]:
    rule = one(render(values, api_versions=(MONITORING_API,)), "PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alerts(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool comes with Debian's prometheus package (make setup)"
    return subprocess.run([binary, *args], capture_output=True, text=True, check=False)


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups()}))
    return path


def test_the_rule_has_the_four_alerts_and_promtool_accepts_them(rules_file: Path) -> None:
    assert set(alerts(rule_groups())) == set(ALERTS)
    result = promtool("check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_read_only_metrics_the_code_exports() -> None:
    for name, rule in alerts(rule_groups()).items():
        unknown = metric_names(rule["expr"]) - exported()
        assert not unknown, f"{name}: {sorted(unknown)}"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]


def test_thresholds_come_from_values() -> None:
    changed = alerts(
        rule_groups(
            {
                "prometheusRule.versionLag.versions": "3",
                "prometheusRule.versionLag.for": '"2m"',
                "prometheusRule.prewarmSlow.seconds": "12.5",
                "prometheusRule.syncStalled.window": '"30m"',
            }
        )
    )
    assert changed["WeightSyncVersionLag"]["expr"].rstrip().endswith(">= 3")
    assert changed["WeightSyncVersionLag"]["for"] == "2m"
    assert changed["WeightSyncPrewarmSlow"]["expr"].rstrip().endswith("> 12.5")
    assert "[30m]" in changed["WeightSyncSyncStalled"]["expr"]


def series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": values}


def firing(alert: str, at: str, *fired: dict[str, str]) -> dict[str, Any]:
    """Which alerts promtool must see firing at `at` (none: the alert must not fire)."""
    return {
        "eval_time": at,
        "alertname": alert,
        "exp_alerts": [{"exp_labels": labels} for labels in fired],
    }


def run_rule_test(
    tmp_path: Path, rules_file: Path, input_series: list[Any], checks: list[Any]
) -> None:
    """promtool's rule unit test over the chart's rules (annotations are checked above)."""
    groups = yaml.safe_load(rules_file.read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # promtool would compare their rendered text too
    rules_file.write_text(yaml.safe_dump({"groups": groups}))
    test = {
        "rule_files": [str(rules_file)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": checks}],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def agent(weightsync: str, pod: str, role: str = "sink", **extra: str) -> str:
    labels = {"namespace": "rl", "weightsync": weightsync, "role": role, "pod": pod, **extra}
    return ", ".join(f'{key}="{value}"' for key, value in labels.items())


def test_sync_stalled_fires_when_rounds_only_fail(tmp_path: Path, rules_file: Path) -> None:
    rounds = "weightsync_rounds_total"
    inputs = [
        # Both label sets exist from the agent's start at 0 (so the first failure counts).
        series(rounds, agent("stuck", "engine-0", result="failed"), "0+1x40"),
        series(rounds, agent("stuck", "engine-0", result="ok"), "3+0x40"),
        # Failures now and then, but rounds also succeed: not stalled.
        series(rounds, agent("fine", "engine-1", result="failed"), "0+1x40"),
        series(rounds, agent("fine", "engine-1", result="ok"), "0+1x40"),
    ]
    expected = {"namespace": "rl", "weightsync": "stuck", "severity": "critical"}
    checks = [
        firing("WeightSyncSyncStalled", "3m"),  # failing, but not for 5m yet
        firing("WeightSyncSyncStalled", "10m", expected),
    ]
    run_rule_test(tmp_path, rules_file, inputs, checks)


def test_version_lag_fires_for_the_pod_that_stays_behind(tmp_path: Path, rules_file: Path) -> None:
    inputs = [
        series("weightsync_operator_current_version", 'namespace="rl", name="tiny"', "10+1x30"),
        series("weightsync_current_version", agent("tiny", "engine-0"), "10+1x30"),
        series("weightsync_current_version", agent("tiny", "engine-1"), "10x30"),
        # A source's version never counts as lag.
        series("weightsync_current_version", agent("tiny", "trainer-0", role="source"), "0x30"),
    ]
    expected = {"namespace": "rl", "weightsync": "tiny", "pod": "engine-1", "severity": "warning"}
    checks = [
        firing("WeightSyncVersionLag", "5m"),
        firing("WeightSyncVersionLag", "15m", expected),
    ]
    run_rule_test(tmp_path, rules_file, inputs, checks)


def test_recovery_failing_needs_failures_without_a_success(
    tmp_path: Path, rules_file: Path
) -> None:
    recoveries = "weightsync_recoveries_total"
    inputs = [
        series(recoveries, agent("tiny", "engine-2", result="failed"), "0+1x30"),
        series(recoveries, agent("tiny", "engine-2", result="done"), "0x30"),
        series(recoveries, agent("tiny", "engine-3", result="failed"), "0+1x30"),
        series(recoveries, agent("tiny", "engine-3", result="done"), "0+1x30"),
    ]
    expected = {"namespace": "rl", "weightsync": "tiny", "pod": "engine-2", "severity": "warning"}
    checks = [firing("WeightSyncRecoveryFailing", "12m", expected)]
    run_rule_test(tmp_path, rules_file, inputs, checks)


def test_prewarm_slow_fires_on_the_p90(tmp_path: Path, rules_file: Path) -> None:
    def buckets(weightsync: str, below: str, counts: dict[str, str]) -> list[dict[str, str]]:
        return [
            series(
                "weightsync_prewarm_duration_seconds_bucket",
                agent(weightsync, "engine-0", le=le),
                counts.get(le, below),
            )
            for le in ("1.0", "10.0", "30.0", "60.0", "+Inf")
        ]

    slow = buckets("slow", "0x90", {"60.0": "0+1x90", "+Inf": "0+1x90"})
    fast = buckets("fast", "0+1x90", {})
    expected = {"namespace": "rl", "weightsync": "slow", "severity": "warning"}
    checks = [
        firing("WeightSyncPrewarmSlow", "10m"),  # slow, but not for 15m yet
        firing("WeightSyncPrewarmSlow", "40m", expected),
    ]
    run_rule_test(tmp_path, rules_file, [*slow, *fast], checks)
