"""The Grafana dashboards: valid JSON, sound layout, and queries over metrics the code exports."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from docs.scripts.render_dashboard import panels, substitute

from tests.unit.chart.exported import exported
from tests.unit.chart.helm import CHART
from tests.unit.chart.promql import metric_names

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
GRID_WIDTH = 24


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def all_exprs() -> list[tuple[str, str]]:
    return [
        (f"{path.name}: {panel.title} [{target.ref_id}]", target.expr)
        for path in DASHBOARDS
        for panel in panels(load(path))
        for target in panel.targets
    ]


def test_there_are_dashboards() -> None:
    assert [path.name for path in DASHBOARDS] == ["weightsync.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_identity_and_variables(path: Path) -> None:
    dashboard = load(path)
    assert dashboard["uid"]
    assert dashboard["title"]
    assert "id" not in dashboard  # Grafana assigns ids; a fixed one collides on import
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_have_unique_ids_and_do_not_overlap(path: Path) -> None:
    dashboard = load(path)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        refs = [target["refId"] for target in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]


@pytest.mark.parametrize(("where", "expr"), all_exprs(), ids=[w for w, _ in all_exprs()])
def test_every_query_reads_only_metrics_the_code_exports(where: str, expr: str) -> None:
    assert "__name__" not in expr, f"{where}: name metrics plainly so this test can read them"
    names = metric_names(expr)
    assert names, f"{where}: no metric in {expr!r}"
    unknown = names - exported()
    assert not unknown, f"{where}: {sorted(unknown)} are not exported by weightsync"


def test_the_dashboard_covers_every_round_and_membership_metric() -> None:
    used = set().union(*(metric_names(expr) for _, expr in all_exprs()))
    wanted = {
        "weightsync_round_duration_seconds_bucket",
        "weightsync_round_bytes_total",
        "weightsync_round_bandwidth_bytes_per_second",
        "weightsync_current_version",
        "weightsync_operator_current_version",
        "weightsync_prewarm_duration_seconds_bucket",
        "weightsync_round_failures_total",
        "weightsync_recovery_duration_seconds_bucket",
        "weightsync_recovery_bandwidth_bytes_per_second",
        "weightsync_recovery_failures_total",
    }
    assert wanted <= used, sorted(wanted - used)


def test_promtool_parses_every_query(tmp_path: Path) -> None:
    """Prometheus's own parser: each query becomes a recording rule that promtool checks."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package (make setup)"
    rules = [
        {"record": f"dashboard:query_{index}", "expr": substitute(expr, {}, step=15, span=3600)}
        for index, (_, expr) in enumerate(all_exprs())
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le, pod) (rate(a_bucket{role="x", pod=~"$pod"}[5m]))', {"a_bucket"}),
        (
            'max by (ns) (label_replace(b, "w", "$1", "name", "(.+)")) - on (ns) '
            "group_right c{role='sink'}",
            {"b", "c"},
        ),
        ("histogram_quantile(0.9, sum without (pod) (rate(d[1h:5m]))) > 30 unless e", {"d", "e"}),
        ("count(f offset 5m) + bool 1", {"f"}),
    ],
)
def test_the_metric_name_reader(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
