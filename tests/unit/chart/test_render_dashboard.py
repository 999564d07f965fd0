"""docs/scripts/render_dashboard.py: query extraction, Grafana's substitutions, the PNG."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from docs.scripts import render_dashboard
from docs.scripts.render_dashboard import (
    axis_scale,
    legend,
    panels,
    series_points,
    substitute,
    tick_label,
)

RECORDING = Path(__file__).parent / "data" / "dashboard_recording.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def dashboard() -> dict[str, object]:
    document: dict[str, object] = json.loads(render_dashboard.DASHBOARD.read_text())
    return document


def test_panels_are_the_query_panels_in_layout_order() -> None:
    found = panels(dashboard())
    titles = [panel.title for panel in found]
    assert titles[:2] == ["Round latency p50 / p99", "Bytes per round"]
    assert all(panel.targets for panel in found)
    assert "Rounds" not in titles  # a row, not a panel
    latency = found[0]
    assert latency.unit == "s"
    assert [t.ref_id for t in latency.targets] == ["A", "B"]
    assert latency.targets[1].legend == "p99 {{weightsync}}"


def test_panels_by_title_and_unknown_titles() -> None:
    assert [p.title for p in panels(dashboard(), ["Bytes per round"])] == ["Bytes per round"]
    with pytest.raises(ValueError, match="no query panels titled"):
        panels(dashboard(), ["Nope"])


def test_substitute_grafana_variables() -> None:
    expr = 'rate(x{namespace=~"$namespace", weightsync=~"${weightsync}"}[$__rate_interval])'
    assert substitute(expr, {"namespace": "rl"}, step=5, span=600) == (
        'rate(x{namespace=~"rl", weightsync=~".*"}[60s])'
    )
    assert substitute("increase(x[$__rate_interval])", {}, step=30, span=600) == (
        "increase(x[120s])"
    )
    assert substitute("x[$__range] offset $__interval", {}, step=15, span=3600) == (
        "x[3600s] offset 15s"
    )
    # Regex back-references in label_replace are not variables.
    assert '"$1"' in substitute('label_replace(x, "a", "$1", "b", "(.+)")', {}, step=5, span=60)


def test_legend_formats() -> None:
    labels = {"__name__": "m", "pod": "engine-0", "weightsync": "tiny"}
    assert legend("p50 {{weightsync}} / {{ pod }}", labels) == "p50 tiny / engine-0"
    assert legend("", labels) == '{pod="engine-0", weightsync="tiny"}'
    assert legend("{{missing}}", labels) == ""


@pytest.mark.parametrize(
    ("unit", "peak", "value", "text"),
    [
        ("s", 0.0421, 0.0421, "42.1 ms"),
        ("s", 30.0, 2.5, "2.5 s"),
        ("bytes", 16.06e9, 16.06e9, "14.96 GiB"),
        ("bytes", 512, 512, "512 B"),
        ("Bps", 300 * 2**30, 128 * 2**30, "128 GiB/s"),
        ("none", 120, 7, "7"),
        ("ops", 0.3, 0.25, "0.25/s"),
        ("short", 1500, 1500, "1500"),
    ],
)
def test_axes_use_grafanas_units(unit: str, peak: float, value: float, text: str) -> None:
    divisor, suffix = axis_scale(unit, peak)
    assert tick_label(value / divisor, suffix) == text


def test_gaps_in_a_series_break_its_line_and_lonely_points_show() -> None:
    values = [[100, "1"], [105, "2"], [140, "3"], [200, "4"], [205, "5"]]
    xs, ys, lonely = series_points(values, start=100, step=5)
    assert [round(x * 60) for x in xs] == [0, 5, 10, 40, 45, 100, 105]
    assert [y if math.isfinite(y) else None for y in ys] == [1, 2, None, 3, None, 4, 5]
    assert lonely == [3]


def test_the_recording_covers_every_panel_query() -> None:
    recording = json.loads(RECORDING.read_text())
    assert recording["format"] == render_dashboard.RECORDING_FORMAT
    for panel in panels(dashboard()):
        for target in panel.targets:
            entry = recording["panels"][panel.title][target.ref_id]
            step, span = recording["step"], recording["end"] - recording["start"]
            assert entry["expr"] == substitute(target.expr, {}, step=step, span=span)


def test_render_a_recording_into_a_png(tmp_path: Path) -> None:
    recording = json.loads(RECORDING.read_text())
    out = render_dashboard.render(recording, dashboard(), tmp_path / "dashboard.png")
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    rows = -(-len(panels(dashboard())) // 3)
    assert (width, height) == (3 * 640, rows * 360)
    assert len(data) > 100_000  # lines, legends and labels, not blank axes


def test_the_command_line_renders_from_a_recording(tmp_path: Path) -> None:
    out = tmp_path / "latency.png"
    argv = ["--results", str(RECORDING), "--panel", "Round latency p50 / p99", "--out", str(out)]
    assert render_dashboard.main(argv) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE
