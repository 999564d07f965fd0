"""The benchmark's phase breakdown: one round's traces from every process, lined up.

Sources: the agents' `round phases` log lines (`weightsync.agent.trace.PhaseTrace`), the
reference engines' `update phases` lines and the Publisher's `last_timings`. All
processes run on one host, so their wall clocks (`start_unix`) line them up.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.agent.trace import PHASES_LOG_PREFIX
from weightsync.client.filling import PublishTimings
from weightsync.reference.engine import UPDATE_LOG_PREFIX

Summary = dict[str, Any]


def read_summaries(log: Path, prefix: str) -> list[Summary]:
    """Every JSON summary a process logged after `prefix`, in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        at = line.find(prefix)
        if at >= 0:
            out.append(json.loads(line[at + len(prefix) :]))
    return out


@dataclass
class RoundRecord:
    """One timed round: what the bench saw and what each process logged about it."""

    version: int
    seconds: float
    started_unix: float
    publisher: PublishTimings
    source: Summary | None = None
    sinks: list[Summary] = field(default_factory=list)
    engines: list[Summary] = field(default_factory=list)


def attach_logs(
    records: Sequence[RoundRecord],
    agent_logs: Mapping[str, Path],
    engine_logs: Iterable[Path],
) -> None:
    """Fill each record's source, sink and engine summaries from the processes' logs."""
    by_version = {r.version: r for r in records}
    for log in agent_logs.values():
        for summary in read_summaries(log, PHASES_LOG_PREFIX):
            record = by_version.get(int(summary["version"]))
            if record is None:
                continue
            if summary.get("role") == "source":
                record.source = summary
            else:
                record.sinks.append(summary)
    for log in engine_logs:
        for summary in read_summaries(log, UPDATE_LOG_PREFIX):
            record = by_version.get(int(summary["version"]))
            if record is not None and summary.get("outcome") == "committed":
                record.engines.append(summary)


def median_record(records: Sequence[RoundRecord]) -> RoundRecord:
    ordered = sorted(records, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


def _span(summary: Summary | None, name: str) -> tuple[int, float, float] | None:
    if summary is None:
        return None
    value = summary.get("spans", {}).get(name)
    return None if value is None else (int(value[0]), float(value[1]), float(value[2]))


def _mean_span(summaries: Sequence[Summary], name: str) -> tuple[int, float, float] | None:
    spans = [s for s in (_span(x, name) for x in summaries) if s is not None]
    if not spans:
        return None
    return (
        spans[0][0],
        statistics.fmean(s[1] for s in spans),
        max(s[2] for s in spans),
    )


def _row(where: str, what: str, span: tuple[int, float, float] | None, note: str = "") -> str:
    if span is None:
        return ""
    count, total, longest = span
    return f"  {where:<9} {what:<44} {count:>5} {total:>9.2f} {longest:>8.2f}  {note}"


def _wire(summary: Summary | None, mark: str, nbytes: int) -> str:
    """GPU time from the first issue to the last bucket's completion, and its rate."""
    gpu = (summary or {}).get("gpu_ms", {})
    done = gpu.get(mark)
    if not done:
        return "n/a"
    milliseconds = float(done[-1])
    rate = nbytes / (milliseconds / 1000) / 2**30 if milliseconds > 0 else float("nan")
    return f"{milliseconds:.2f} ms on the GPU ({rate:.0f} GiB/s)"


def _at(summary: Summary, origin: float, mark: str | None = None) -> float:
    """A summary's start (or a mark in it), in ms after `origin` (a wall-clock time)."""
    offset = float(summary["marks"][mark]) if mark else 0.0
    return (float(summary["start_unix"]) - origin) * 1000 + offset


def breakdown(title: str, record: RoundRecord) -> list[str]:
    """Lines describing where one round's time went, process by process."""
    source, sinks, pub = record.source, record.sinks, record.publisher
    nbytes = int((source or {}).get("bytes", 0))
    buckets = int((source or {}).get("buckets", pub.buckets))
    lines = [
        f"phase breakdown: {title}, version {record.version}, "
        f"{buckets} buckets, {len(sinks)} sink(s)",
        f"  {'where':<9} {'phase':<44} {'count':>5} {'total ms':>9} {'max ms':>8}",
        f"  {'trainer':<9} {'publish() wall time':<44} {1:>5} {record.seconds * 1000:>9.2f}",
        _row(
            "trainer",
            "before the round: checks, describe, GPU sync",
            (1, pub.prepare * 1000, pub.sync * 1000),
            "max: the GPU sync",
        ),
        _row(
            "trainer",
            "pack: D2D copy into slots (0: the agent packs)",
            (pub.buckets, pub.pack * 1000, pub.longest_pack * 1000),
            "overlaps earlier buckets",
        ),
    ]
    source_rows = [
        ("announce", "doorbell + layout key in the TCPStore", ""),
        ("fill", "fill: queue the pack here, or await Filled", "GPU: agent packs"),
        ("slot_wait", "slot_wait: slot's last bucket still sending", "wire-bound"),
        ("issue", "issue a broadcast (collective thread)", ""),
        ("drain", "drain: last buckets on the wire", ""),
        ("engine_begin", "local engine: begin", ""),
        ("engine_load", "local engine: stage + copy (round trip)", "overlaps fills"),
        ("engine_wait", "slot held by the local engine", ""),
        ("stage_wait", "begin and staging not answered yet", "one copy"),
        ("pack", "queue every bucket's copies (one hop)", "one copy"),
        ("pack_drain", "the packs' last copies on the GPU", ""),
        ("engine_drain", "local engine: after the last fill", ""),
        ("vote_transfer", "vote 1: every rank received", ""),
        ("engine_finish", "local engine: commit", ""),
        ("vote_commit", "vote 2: every engine committed", "incl. sinks' commit"),
    ]
    lines += [_row("source", what, _span(source, name), note) for name, what, note in source_rows]
    sink_rows = [
        ("engine_begin", "engine begin (beside the first receives)", ""),
        ("recv_wait", "recv_wait: bucket not yet arrived", "wire-bound"),
        ("engine_load", "engine load: stage + copy (round trip)", ""),
        ("replica_wait", "  of it: copies to the engine's other GPUs", "TP engines"),
        ("engine_wait", "slot still with the engine", "engine-bound"),
        ("issue", "issue a receive", ""),
        ("engine_drain", "after the last bucket arrived", ""),
        ("vote_transfer", "vote 1", ""),
        ("engine_finish", "engine commit", ""),
        ("vote_commit", "vote 2", ""),
    ]
    lines += [_row("sinks", what, _mean_span(sinks, name), note) for name, what, note in sink_rows]
    if record.engines:
        loads = [e for e in record.engines if int(e.get("loads", 0))]
        if loads:
            lines.append(
                _row(
                    "engines",
                    "inside the engine: staging (+ copy if HTTP)",
                    (
                        int(loads[0]["loads"]),
                        statistics.fmean(float(e["load_ms"]) for e in loads),
                        max(float(e["longest_load_ms"]) for e in loads),
                    ),
                )
            )
            lines.append(
                _row(
                    "engines",
                    "inside the engine: commit",
                    (
                        1,
                        statistics.fmean(float(e.get("commit_ms", 0)) for e in loads),
                        max(float(e.get("commit_ms", 0)) for e in loads),
                    ),
                )
            )
            handoff = _mean_span(sinks, "engine_load") or _span(source, "engine_load")
            if handoff is not None:
                inside = statistics.fmean(float(e["load_ms"]) for e in loads)
                lines.append(
                    f"  {'engines':<9} {'round trip minus time inside the engine':<44} "
                    f"{handoff[0]:>5} {handoff[1] - inside:>9.2f}"
                )
    lines = [line for line in lines if line]
    if source is not None and "packed" in source.get("gpu_ms", {}):  # a direct round
        lines.append(f"  GPU, source's packs: {_wire(source, 'packed', nbytes)}")
    elif source is not None:
        lines.append(f"  wire, source: {_wire(source, 'sent', nbytes)}")
    for sink in sinks[:1]:
        lines.append(f"  wire, sink rank {sink.get('rank')}: {_wire(sink, 'received', nbytes)}")
    if source is not None:
        origin = record.started_unix
        timeline = [f"source round starts +{_at(source, origin):.2f}"]
        if sinks:
            timeline.append(f"last sink wakes +{max(_at(s, origin) for s in sinks):.2f}")
            streamed = [_at(s, origin, "streamed") for s in sinks if "streamed" in s["marks"]]
            if streamed:
                timeline.append(f"last sink has every bucket loaded +{max(streamed):.2f}")
        if "streamed" in source["marks"]:
            timeline.append(f"source streamed +{_at(source, origin, 'streamed'):.2f}")
        ended = _at(source, origin) + float(source["total_ms"])
        timeline.append(f"source round ends +{ended:.2f}")
        timeline.append(f"publish() returns +{record.seconds * 1000:.2f}")
        lines.append("  timeline (ms after publish() was called): " + ", ".join(timeline))
    return lines
