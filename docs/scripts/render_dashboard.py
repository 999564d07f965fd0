"""Render the Grafana dashboard's panels into one PNG, from a running Prometheus or a recording.

The docs show what an operator sees without running Grafana: every query of every panel
in `charts/weightsync/dashboards/weightsync.json` is run as a Prometheus range query
(Grafana's `$variables` substituted), and each panel is drawn with its title, unit and
legend format.

    # query a live Prometheus (the e2e stack's, or a port-forward), keep the results
    python docs/scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 \\
        --since 15m --step 15s --save-results results.json --out dashboard.png
    # draw again from a recording, no Prometheus needed
    python docs/scripts/render_dashboard.py --results results.json --out dashboard.png

Needs matplotlib (the `dev` extra) only to draw.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "weightsync" / "dashboards" / "weightsync.json"
RECORDING_FORMAT = 1
HTTP_TIMEOUT_SECONDS = 30.0

_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))")  # not $1: a regex group
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Target:
    ref_id: str
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[Target, ...]


def panels(dashboard: Mapping[str, Any], titles: Sequence[str] = ()) -> list[Panel]:
    """The dashboard's query panels in layout order (rows skipped), optionally by title."""
    found = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row" or not panel.get("targets"):
            continue
        if titles and panel["title"] not in titles:
            continue
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        targets = tuple(
            Target(t["refId"], t["expr"], t.get("legendFormat", "")) for t in panel["targets"]
        )
        found.append(Panel(panel["title"], unit, targets))
    missing = set(titles) - {panel.title for panel in found}
    if missing:
        raise ValueError(f"no query panels titled {sorted(missing)}")
    return found


def seconds(duration: str) -> float:
    match = _DURATION.match(duration)
    if match is None:
        raise ValueError(f"not a duration: {duration!r} (use e.g. 15s, 5m, 1h)")
    return int(match[1]) * _SECONDS[match[2]]


def substitute(expr: str, variables: Mapping[str, str], *, step: float, span: float) -> str:
    """Grafana's variables in `expr`: template variables (unset ones mean "All": `.*`),
    `$__rate_interval` (four steps, at least one minute, as Grafana does for a 15 s scrape),
    `$__interval` (the step) and `$__range` (the whole span)."""
    builtins = {
        "__rate_interval": f"{max(4 * int(step), 60)}s",
        "__interval": f"{int(step)}s",
        "__range": f"{int(span)}s",
    }

    def replace(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name in builtins:
            return builtins[name]
        return variables.get(name, ".*")

    return _VARIABLE.sub(replace, expr)


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """Grafana's legend: `{{label}}` replaced; without a format, the series' label set."""
    if not fmt:
        shown = {k: v for k, v in labels.items() if k != "__name__"}
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items())) + "}"
    return _LEGEND.sub(lambda m: labels.get(m[1], ""), fmt)


# -- recording -------------------------------------------------------------------------


def query_range(base_url: str, expr: str, start: float, end: float, step: float) -> Any:
    params = urllib.parse.urlencode(
        {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
    )
    url = f"{base_url.rstrip('/')}/api/v1/query_range?{params}"
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_SECONDS) as reply:  # noqa: S310
        body = json.load(reply)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error', body)}")
    return body["data"]["result"]


def record(
    dashboard: Mapping[str, Any],
    base_url: str,
    *,
    start: float,
    end: float,
    step: float,
    variables: Mapping[str, str],
) -> dict[str, Any]:
    """Run every panel's queries; the recording `render` draws from."""
    recorded: dict[str, Any] = {}
    for panel in panels(dashboard):
        for target in panel.targets:
            expr = substitute(target.expr, variables, step=step, span=end - start)
            recorded.setdefault(panel.title, {})[target.ref_id] = {
                "expr": expr,
                "result": query_range(base_url, expr, start, end, step),
            }
    return {
        "format": RECORDING_FORMAT,
        "start": start,
        "end": end,
        "step": step,
        "variables": dict(variables),
        "panels": recorded,
    }


# -- drawing ---------------------------------------------------------------------------

_IEC = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def axis_scale(unit: str, peak: float) -> tuple[float, str]:
    """(divisor, suffix) that put a panel's values in Grafana's unit at a readable size:
    bytes and bytes/s in IEC multiples, seconds below one as milliseconds."""
    if unit in ("bytes", "Bps"):
        power = 0
        while peak >= 1024 ** (power + 1) and power < len(_IEC) - 1:
            power += 1
        return 1024.0**power, _IEC[power] + ("/s" if unit == "Bps" else "")
    if unit == "s":
        return (0.001, "ms") if 0 < peak < 1 else (1.0, "s")
    return 1.0, "/s" if unit == "ops" else ""


def tick_label(value: float, suffix: str) -> str:
    text = f"{value:.4g}"
    if not suffix:
        return text
    return f"{text}{suffix}" if suffix.startswith("/") else f"{text} {suffix}"


def series_points(
    values: Sequence[Sequence[Any]], start: float, step: float
) -> tuple[list[float], list[float], list[int]]:
    """Minutes and values of one series, NaN where Prometheus had no sample (so the line
    breaks there, as Grafana's does), and the indices of points with no neighbour (drawn
    as dots, or they would not show at all)."""
    xs: list[float] = []
    ys: list[float] = []
    previous: float | None = None
    for stamp, text in values:
        moment, value = float(stamp), float(text)
        if previous is not None and moment - previous > 1.5 * step:
            xs.append((previous + step - start) / 60)
            ys.append(math.nan)
        xs.append((moment - start) / 60)
        ys.append(value)
        previous = moment
    finite = [math.isfinite(y) for y in ys]
    lonely = [
        i
        for i, ok in enumerate(finite)
        if ok and not (i > 0 and finite[i - 1]) and not (i + 1 < len(ys) and finite[i + 1])
    ]
    return xs, ys, lonely


def render(
    recording: Mapping[str, Any],
    dashboard: Mapping[str, Any],
    out: Path,
    *,
    titles: Sequence[str] = (),
    columns: int = 3,
) -> Path:
    """Draw the recording's panels into a PNG at `out`; return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    chosen = panels(dashboard, titles)
    rows = math.ceil(len(chosen) / columns)
    figure, axes_grid = plt.subplots(
        rows, columns, figsize=(6.4 * columns, 3.6 * rows), squeeze=False
    )
    start, end, step = (float(recording[key]) for key in ("start", "end", "step"))
    for index, panel in enumerate(chosen):
        axes = axes_grid[index // columns][index % columns]
        lines = []
        for target in panel.targets:
            entry = recording["panels"].get(panel.title, {}).get(target.ref_id)
            for series in entry["result"] if entry else []:
                xs, ys, lonely = series_points(series["values"], start, step)
                if any(math.isfinite(y) for y in ys):
                    lines.append((xs, ys, lonely, legend(target.legend, series["metric"])))
        peak = max((abs(y) for _, ys, _, _ in lines for y in ys if math.isfinite(y)), default=0)
        divisor, suffix = axis_scale(panel.unit, peak)
        for xs, ys, lonely, label in lines:
            scaled = [y / divisor for y in ys]
            (line,) = axes.plot(xs, scaled, linewidth=1.4, label=label)
            if lonely:
                dots = [xs[i] for i in lonely], [scaled[i] for i in lonely]
                axes.plot(*dots, "o", markersize=3, color=line.get_color())
        axes.set_title(panel.title, fontsize=11, loc="left")
        axes.set_xlim(0, (end - start) / 60)
        axes.set_xlabel("minutes", fontsize=8)
        axes.grid(visible=True, alpha=0.3)
        axes.tick_params(labelsize=8)
        axes.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, s=suffix: tick_label(v, s)))
        if lines:
            if panel.unit != "none":
                axes.set_ylim(bottom=0)
            axes.legend(fontsize=7, loc="upper left", ncol=2 if len(lines) > 4 else 1)
        else:
            axes.text(0.5, 0.5, "No data", ha="center", va="center", transform=axes.transAxes,
                      fontsize=12, color="grey")  # fmt: skip
    for index in range(len(chosen), rows * columns):
        axes_grid[index // columns][index % columns].axis("off")
    began = datetime.fromtimestamp(start, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    figure.suptitle(
        f"{dashboard.get('title', 'dashboard')}: {began}, {(end - start) / 60:.0f} min,"
        f" step {recording['step']:g}s",
        fontsize=12,
    )
    figure.tight_layout(rect=(0, 0, 1, 0.97))  # leave the top for the title
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", help="base URL of a Prometheus to query")
    source.add_argument("--results", type=Path, help="a recording saved by --save-results")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--since", default="15m", help="range to query, ending now")
    parser.add_argument("--step", default="15s", help="range query resolution")
    parser.add_argument("--var", action="append", default=[], help="NAME=VALUE (dashboard var)")
    parser.add_argument("--panel", action="append", default=[], help="draw only these titles")
    parser.add_argument("--save-results", type=Path, help="write the recording here")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)

    dashboard = json.loads(args.dashboard.read_text())
    if args.prometheus:
        end = time.time()
        variables = dict(item.split("=", 1) for item in args.var)
        recording = record(
            dashboard,
            args.prometheus,
            start=end - seconds(args.since),
            end=end,
            step=seconds(args.step),
            variables=variables,
        )
        if args.save_results:
            args.save_results.write_text(json.dumps(recording, indent=1) + "\n")
    else:
        recording = json.loads(args.results.read_text())
    print(render(recording, dashboard, args.out, titles=args.panel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
