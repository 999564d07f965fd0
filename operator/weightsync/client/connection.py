"""The Publisher's errors and how it finds and reaches its agent's Unix socket."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from weightsync.api import agent_env


class PublisherError(RuntimeError):
    """The publish could not even start or complete its exchange with the agent."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class AgentUnavailableError(PublisherError):
    """The source agent's socket is missing, refused, or closed mid-exchange."""


class LayoutChangedError(PublisherError):
    """The agent no longer accepts this layout and renegotiation did not settle it."""


def agent_socket(environ: Mapping[str, str]) -> str:
    """The injected agent's socket: `WEIGHTSYNC_SOCKET`; in a trainer pod of several ranks
    a template that this rank's `LOCAL_RANK` (as torchrun sets it) completes."""
    path = environ.get(agent_env.SOCKET) or agent_env.SOCKET_PATH
    if agent_env.LOCAL_RANK_PLACEHOLDER not in path:
        return path
    local = environ.get("LOCAL_RANK", "")
    if not local.isdigit():
        raise PublisherError(
            "no_local_rank",
            f"this trainer pod runs several ranks ({agent_env.SOCKET}={path}): set LOCAL_RANK"
            " to this process's local rank, as torchrun does",
        )
    return path.replace(agent_env.LOCAL_RANK_PLACEHOLDER, local)


def connect(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise AgentUnavailableError(
            "agent_unavailable", f"no weightsync agent at {path}: {exc}"
        ) from exc
    return sock
