"""Where one round's time goes on one rank."""

from __future__ import annotations

import json
import logging
import time

import torch

log = logging.getLogger(__name__)

PHASES_LOG_PREFIX = "round phases "


class PhaseTrace:
    """Where one round's time goes on this rank, logged as one line when it ends.

    * spans: host time of each awaited phase (count, total, max), e.g. `fill` (the
      Publisher packing a bucket), `slot_wait` (a slot still on the wire), `recv_wait`
      (a sink waiting for a bucket), `engine_load`, the votes. The phase a rank waits on
      most is what bounds it: a source that mostly waits in `slot_wait` is wire-bound.
    * marks: host time since the round started at which a milestone was reached.
    * gpu: CUDA events recorded on the device's current stream right after a bucket's
      transfer completed (the stream waits on the collective first), so their spacing is
      the wire's pace on the GPU, whatever the host's polling added.

    `start_unix` lets a reader line up the traces of several processes on one host.
    """

    def __init__(self, device: torch.device) -> None:
        self.started = time.perf_counter()
        self.started_unix = time.time()
        self._spans: dict[str, list[float]] = {}
        self._marks: dict[str, float] = {}
        self._device = device if device.type == "cuda" else None
        self._gpu: list[tuple[str, torch.cuda.Event]] = []

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, name: str, since: float) -> None:
        """Count the time from `since` (a `now()`) to now as one `name` span."""
        seconds = time.perf_counter() - since
        entry = self._spans.get(name)
        if entry is None:
            self._spans[name] = [1, seconds, seconds]
        else:
            entry[0] += 1
            entry[1] += seconds
            entry[2] = max(entry[2], seconds)

    def mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter() - self.started

    def gpu_mark(self, name: str) -> None:
        if self._device is None:
            return
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        self._gpu.append((name, event))

    def summary(self, *, gpu: bool = True, **extra: object) -> dict[str, object]:
        """The trace as plain JSON values, times in milliseconds."""
        out: dict[str, object] = {
            **extra,
            "start_unix": self.started_unix,
            "total_ms": _ms(time.perf_counter() - self.started),
            "spans": {
                name: [int(count), _ms(total), _ms(longest)]
                for name, (count, total, longest) in self._spans.items()
            },
            "marks": {name: _ms(at) for name, at in self._marks.items()},
        }
        if gpu and self._gpu:
            first = self._gpu[0][1]
            self._gpu[-1][1].synchronize()
            marks: dict[str, list[float]] = {}
            for name, event in self._gpu:
                marks.setdefault(name, []).append(round(first.elapsed_time(event), 3))
            out["gpu_ms"] = marks
        return out

    def log(self, **extra: object) -> None:
        ok = bool(extra.get("ok", True))
        try:
            summary = self.summary(gpu=ok, **extra)
        except RuntimeError as exc:  # an event that never completed: leave the GPU part out
            log.debug("GPU marks unavailable: %s", exc)
            summary = self.summary(gpu=False, **extra)
        log.info("%s%s", PHASES_LOG_PREFIX, json.dumps(summary, separators=(",", ":")))


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
