"""CPU contention beside a cluster test: busy processes at normal priority.

The one stale Ready seen in CI (an engine restarted in place, back Ready on its start-up
weights) came on a loaded 2-core machine; races between the kubelet's restarts, the
agents' health polls and the operator's passes widen when every process waits for a
core. `cpu_load(n)` runs `n` busy loops for the duration of a block, killed by PID after.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """`processes` busy loops while the block runs (none for 0)."""
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(processes)
    ]
    try:
        yield
    finally:
        for proc in busy:
            proc.kill()
        for proc in busy:
            proc.wait(timeout=10)
