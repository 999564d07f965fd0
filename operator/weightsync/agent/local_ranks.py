"""One sidecar, several trainer ranks: an agent process per local rank the pod publishes.

A trainer pod that runs several ranks (torchrun's processes, one per GPU) gets one
sidecar whose `WEIGHTSYNC_LOCAL_RANKS` lists the local ranks that publish. Each needs
an agent of its own (a process is one rank of a collective group), so the sidecar's
process supervises one agent per local rank, each told apart by its environment:
device `cuda:<i>` (or the CPU), control and metrics ports offset by i, its own
Publisher socket, and, when it serves several, the member name `<pod>[<i>]` the
operator plans it under.

The agents live and die together: when one exits, the others are stopped and the
sidecar exits with its code, so the kubelet restarts the container and the operator
plans every rank of the pod anew (a rank restarted alone would hold its generation
back anyway). SIGTERM and SIGINT are passed on.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from types import FrameType

from weightsync.api import agent_env

log = logging.getLogger(__name__)

_STOP_GRACE_SECONDS = 10.0  # what a stopping agent gets before it is killed


def parse_local_ranks(value: str) -> list[int]:
    """`"0,1,3"` -> [0, 1, 3]; refuses anything but distinct non-negative integers."""
    ranks = [int(item) for item in value.split(",") if item.strip()]
    if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise ValueError(f"{agent_env.LOCAL_RANKS} must list distinct local ranks, got {value!r}")
    return ranks


def rank_environment(environ: Mapping[str, str], local: int, several: bool) -> dict[str, str]:
    """The environment of local rank `local`'s agent, from the sidecar's."""
    env = dict(environ)
    env.pop(agent_env.LOCAL_RANKS, None)
    device = env.get(agent_env.DEVICE, "cpu")
    if device.startswith("cuda"):
        env[agent_env.DEVICE] = f"cuda:{local}"
    for name, default in (
        (agent_env.HTTP_PORT, agent_env.DEFAULT_HTTP_PORT),
        (agent_env.METRICS_PORT, agent_env.DEFAULT_METRICS_PORT),
    ):
        base = int(env.get(name, default))
        if base:  # a metrics port of 0 is none, for every rank
            env[name] = str(base + local)
    socket = env.get(agent_env.SOCKET, agent_env.SOCKET_TEMPLATE)
    env[agent_env.SOCKET] = socket.replace(agent_env.LOCAL_RANK_PLACEHOLDER, str(local))
    if several:
        env[agent_env.POD_NAME] = f"{env.get(agent_env.POD_NAME, '')}[{local}]"
    return env


def check_socket(environ: Mapping[str, str]) -> None:
    """Each local rank needs a socket of its own: the path must name the local rank."""
    socket = environ.get(agent_env.SOCKET, agent_env.SOCKET_TEMPLATE)
    if agent_env.LOCAL_RANK_PLACEHOLDER not in socket:
        raise ValueError(
            f"{agent_env.SOCKET} must contain {agent_env.LOCAL_RANK_PLACEHOLDER} when"
            f" {agent_env.LOCAL_RANKS} is set, got {socket!r}"
        )


def supervise(local_ranks: list[int]) -> int:
    """Run an agent per local rank until one exits (or a signal asks); its exit code."""
    several = len(local_ranks) > 1
    procs = {
        local: subprocess.Popen(
            [sys.executable, "-m", "weightsync.agent.main"],
            env=rank_environment(os.environ, local, several),
        )
        for local in local_ranks
    }
    log.info("serving local ranks %s (pids %s)", local_ranks, [p.pid for p in procs.values()])
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while True:
        exited = [(local, p.returncode) for local, p in procs.items() if p.poll() is not None]
        if exited:
            local, code = exited[0]
            if not stopping:
                log.error(
                    "the agent of local rank %d exited (%d): stopping the others", local, code
                )
            break
        time.sleep(0.2)
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_SECONDS
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
