"""Ports for the test stacks' listeners, from below the kernel's ephemeral range.

`bind(("127.0.0.1", 0))` finds a free port in the ephemeral range (32768-60999 by
default), where every outgoing connection on the machine takes its local port too:
between that check and the listener's own bind, a client (a TCPStore's, gloo's, the
operator's) can take the port, and the listener fails with EADDRINUSE (CI saw it once:
an agent of `test_sharded_rounds` could not bind its control port). Below that range
only listeners bind; each port is handed out once per process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOWEST = 15000
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_given: set[int] = set()
_lock = threading.Lock()
_random = random.Random()


def _ephemeral_start() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on now, outside the ephemeral range, not handed out before."""
    top = max(_ephemeral_start(), LOWEST + 1000)
    for _ in range(2000):
        port = _random.randrange(LOWEST, top)
        with _lock:
            if port in _given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _given.add(port)
            return port
    raise RuntimeError(f"no free port between {LOWEST} and {top}")
