"""The scale run's figures and the table it prints, each row beside the issue's target."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

MB = 1_000_000


@dataclass
class Figures:
    pods: int
    start: int
    running_seconds: float = 0.0  # scale-up until every engine pod is Running
    members_after_running: float = 0.0  # ... until the status lists every member
    gates_after_running: float = 0.0  # ... until every gate is True
    scale_up_from: float = 0.0
    scale_up_passes: list[float] = field(default_factory=list)  # until every member shows
    steady_from: float = 0.0
    steady_until: float = 0.0
    round_detection: list[float] = field(default_factory=list)  # a round -> status shows it
    passes: list[float] = field(default_factory=list)  # at `pods`, rounds running
    shared_passes: int = 0
    close: dict[str, float] = field(default_factory=dict)
    open: dict[str, float] = field(default_factory=dict)
    slow: dict[str, Any] = field(default_factory=dict)
    slow_window: tuple[float, float] = (0.0, 0.0)
    slow_passes: list[float] = field(default_factory=list)
    rss_peak: int = 0
    rss_after: int = 0
    plan_bytes: dict[int, int] = field(default_factory=dict)  # by generation
    plans: dict[int, int] = field(default_factory=dict)  # plans delivered, by generation
    operator_log_tracebacks: int = 0
    moved_pods: int = 0  # pods KWOK gave a second address (the stand-in followed them)
    # Requests that reached the load generator before the harness announced their pod's
    # address: (waited, of which unanswered, longest wait). Its delay, not the operator's.
    address_waits: tuple[int, int, float] = (0, 0, 0.0)
    reclosed_gates: int = 0  # in the scale-up: gates closed again after they had opened
    floor: dict[str, float] = field(default_factory=dict)  # the API server's own pace

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}x" if floor > 0 else "n/a"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _seconds(value: float) -> str:
    return f"{value:.2f} s"


def rows(f: Figures) -> list[tuple[str, str, str]]:
    """(figure, measured, target) for the report."""
    p50 = _median(f.passes)
    worst = max(f.passes, default=float("nan"))
    largest = max(f.plan_bytes.values(), default=0)
    total = sum(f.plan_bytes.values())
    detection = max(f.round_detection, default=float("nan"))
    slow = f.slow
    floor = f.floor.get("seconds", 0.0)
    return [
        ("engine pods Running after the scale-up", _seconds(f.running_seconds), ""),
        ("status shows every member, after the last pod is Running",
         _seconds(f.members_after_running), "<= 5 s"),
        ("every gate True, after the last pod is Running", _seconds(f.gates_after_running), ""),
        ("gates closed again after they opened, in the scale-up", str(f.reclosed_gates), "0"),
        (f"reconcile pass p50 / max ({len(f.passes)} passes, {f.shared_passes} shared)",
         f"{p50:.3f} / {worst:.3f} s", "<= 0.2 / 2 s"),
        (f"... reconcile pass p50 / max in the scale-up ({len(f.scale_up_passes)} passes)",
         f"{_median(f.scale_up_passes):.3f} / {max(f.scale_up_passes, default=float('nan')):.3f} s",
         ""),
        ("version flip: operator noticed -> last gate (close / open; x the floor below)",
         f"{f.close.get('reach', 0):.2f} / {f.open.get('reach', 0):.2f} s"
         f" ({_ratio(f.close.get('reach', 0), floor)} / {_ratio(f.open.get('reach', 0), floor)})",
         "<= 2 s"),
        (f"... floor: {int(f.floor.get('patches', 0))} pod status patches straight from the"
         " harness", _seconds(f.floor.get("seconds", 0.0)), ""),
        ("version flip: flip -> operator noticed (close / open)",
         f"{f.close.get('noticed', 0):.2f} / {f.open.get('noticed', 0):.2f} s", ""),
        ("version flip: flip -> status shows it (close / open)",
         f"{f.close.get('status', 0):.2f} / {f.open.get('status', 0):.2f} s", ""),
        ("round -> status shows its version (worst of the steady rounds)", _seconds(detection), ""),
        (f"plan bytes per generation, largest ({len(f.plan_bytes)} generations, {total / MB:.1f} MB"
         " in all)", f"{largest / MB:.2f} MB", "<= 2 MB"),
        ("operator RSS, peak / after scaling in",
         f"{f.rss_peak / MB:.0f} / {f.rss_after / MB:.0f} MB", "<= 300 MB"),
        ("agents slowed past the poll timeout for 30 s: generations planned",
         str(slow.get("generations", "?")), "0"),
        ("... fewest members in the status meanwhile", str(slow.get("fewest_members", "?")),
         str(f.pods + 1)),
        ("... Ready and every gate back, after the agents are",
         _seconds(slow.get("ready_after", 0)), ""),
        ("... reconcile pass max meanwhile", _seconds(max(f.slow_passes, default=0.0)), ""),
        ("tracebacks in the operator's log", str(f.operator_log_tracebacks), "0"),
        ("pods KWOK gave a second address (the load generator follows them)",
         str(f.moved_pods), ""),
        ("agent requests that waited for the harness to announce their address"
         " (unanswered; longest wait)",
         f"{f.address_waits[0]} ({f.address_waits[1]}; {f.address_waits[2]:.2f} s)", ""),
    ]  # fmt: skip


def table(f: Figures) -> str:
    lines = [
        f"one WeightSync, {f.start} -> {f.pods} inference pods",
        "",
        "| figure | measured | target |",
        "|---|---|---|",
    ]
    lines.extend(f"| {name} | {value} | {target} |" for name, value, target in rows(f))
    return "\n".join(lines)
