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
    "WeightSyncRoundsStopped",
    "WeightSyncRecoveryFailing",
    "WeightSyncPrewarmSlow",
    "WeightSyncOperatorDown",
    "WeightSyncWebhookErrors",
    "WeightSyncDegraded",
)
PROMETHEUS_OWN = {"up"}  # series Prometheus itself writes for every target
OPERATOR_JOB = 'job="ws-weightsync-metrics", namespace="weightsync-system"'


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


def test_the_rule_has_every_alert_and_promtool_accepts_them(rules_file: Path) -> None:
    assert set(alerts(rule_groups())) == set(ALERTS)
    result = promtool("check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_read_only_metrics_the_code_exports() -> None:
    for name, rule in alerts(rule_groups()).items():
        unknown = metric_names(rule["expr"]) - exported() - PROMETHEUS_OWN
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
                "prometheusRule.operatorDown.for": '"1m"',
                "prometheusRule.webhookErrors.window": '"20m"',
                "prometheusRule.degraded.for": '"3m"',
                "prometheusRule.roundsStopped.quiet": '"45m"',
            }
        )
    )
    assert changed["WeightSyncOperatorDown"]["for"] == "1m"
    assert "[20m]" in changed["WeightSyncWebhookErrors"]["expr"]
    assert changed["WeightSyncDegraded"]["for"] == "3m"
    assert "[45m]" in changed["WeightSyncRoundsStopped"]["expr"]
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


def test_rounds_stopped_fires_once_rounds_that_ran_stop(tmp_path: Path, rules_file: Path) -> None:
    rounds = "weightsync_rounds_total"
    inputs = [
        # 30 minutes of rounds, then none.
        series(rounds, agent("halted", "trainer-0", role="source", result="ok"), "0+2x30 60x60"),
        # Rounds all along.
        series(rounds, agent("going", "trainer-0", role="source", result="ok"), "0+2x90"),
        # Never a round: nothing stopped.
        series(rounds, agent("idle", "trainer-0", role="source", result="ok"), "0x90"),
    ]
    expected = {"namespace": "rl", "weightsync": "halted", "severity": "warning"}
    checks = [
        firing("WeightSyncRoundsStopped", "40m"),  # quiet for 10m only
        firing("WeightSyncRoundsStopped", "60m", expected),
    ]
    run_rule_test(tmp_path, rules_file, inputs, checks)


def leader(pod: str) -> str:
    return f'{OPERATOR_JOB}, pod="{pod}"'


def test_operator_down_fires_when_no_replica_leads(tmp_path: Path, rules_file: Path) -> None:
    # Both replicas scraped; the leader lost the Lease at minute 6 and nobody took it.
    inputs = [
        series("weightsync_operator_leader", leader("op-a"), "1x5 0x20"),
        series("weightsync_operator_leader", leader("op-b"), "0x25"),
    ]
    expected = {"job": "ws-weightsync-metrics", "namespace": "weightsync-system"}
    checks = [
        firing("WeightSyncOperatorDown", "4m"),
        firing("WeightSyncOperatorDown", "8m"),  # no leader, but not for 5m yet
        firing("WeightSyncOperatorDown", "15m", {**expected, "severity": "critical"}),
    ]
    run_rule_test(tmp_path, rules_file, inputs, checks)


def test_a_failover_is_no_outage(tmp_path: Path, rules_file: Path) -> None:
    # The leader's pod dies at minute 6 (its series ends); the standby leads from then on.
    inputs = [
        series("weightsync_operator_leader", leader("op-a"), "1x5"),
        series("weightsync_operator_leader", leader("op-b"), "0x5 1x20"),
    ]
    checks = [firing("WeightSyncOperatorDown", at) for at in ("4m", "8m", "15m", "24m")]
    run_rule_test(tmp_path, rules_file, inputs, checks)


def test_operator_down_fires_when_it_is_not_scraped_at_all(
    tmp_path: Path, rules_file: Path
) -> None:
    # Another release's operator leads: it is not this one.
    other = 'job="other-metrics", namespace="weightsync-system", pod="x"'
    inputs = [series("weightsync_operator_leader", other, "1x20")]
    expected = {"job": "ws-weightsync-metrics", "namespace": "weightsync-system"}
    checks = [firing("WeightSyncOperatorDown", "10m", {**expected, "severity": "critical"})]
    run_rule_test(tmp_path, rules_file, inputs, checks)


def test_webhook_errors_fire_on_errors_not_denials(tmp_path: Path, rules_file: Path) -> None:
    admissions = "weightsync_operator_admission_requests_total"
    inputs = [
        series(admissions, 'webhook="inject-agent", result="error"', "0x5 0+1x20"),
        series(admissions, 'webhook="validate-claims", result="denied"', "0+1x25"),
        series(admissions, 'webhook="validate-claims", result="error"', "0x25"),
    ]
    expected = {"webhook": "inject-agent", "severity": "warning"}
    checks = [
        firing("WeightSyncWebhookErrors", "4m"),
        firing("WeightSyncWebhookErrors", "15m", expected),
    ]
    run_rule_test(tmp_path, rules_file, inputs, checks)


def test_degraded_fires_for_the_weightsync_degraded_long_enough(
    tmp_path: Path, rules_file: Path
) -> None:
    condition = "weightsync_operator_condition"
    inputs = [
        series(condition, 'namespace="rl", name="bad", condition="Degraded"', "0x2 1x30"),
        series(condition, 'namespace="rl", name="bad", condition="Ready"', "1x32"),
        series(condition, 'namespace="rl", name="blip", condition="Degraded"', "0x2 1x3 0x27"),
        series(condition, 'namespace="rl", name="good", condition="Degraded"', "0x32"),
        series(condition, 'namespace="rl", name="good", condition="Ready"', "1x32"),
    ]
    expected = {"namespace": "rl", "weightsync": "bad", "severity": "warning"}
    checks = [
        firing("WeightSyncDegraded", "8m"),  # Degraded since 2m: not for 10m yet
        firing("WeightSyncDegraded", "20m", expected),
    ]
    run_rule_test(tmp_path, rules_file, inputs, checks)
