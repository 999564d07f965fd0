"""The engine container's readiness probe, answered by its agent. Pure.

An inference pod behind the weights gate gets its engine container's readiness probe
pointed at its agent (`api.engine_probe`): ready only while the engine is healthy and
serves what its agent loaded into that very process. The kubelet can then never turn
an engine restarted in place Ready on a gate it cached before the restart
(docs/reliability.md). The user's own check is kept: an HTTP GET or TCP connect moves
into the agent, which repeats it (`EngineProbe`), and the probe's timing stays theirs.
An exec or gRPC check cannot be repeated from another container: such a probe is left
as it is, and the gate alone guards that pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.api.engine_probe import ENGINE_READY_PATH, EngineProbe

# The probe given to an engine container that had none: its readiness is its health.
_DEFAULT_TIMING = {"periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 3}
_TIMING = (
    "initialDelaySeconds", "periodSeconds", "timeoutSeconds", "successThreshold",
    "failureThreshold",
)  # fmt: skip
_KUBELET_TIMEOUT_SECONDS = 1  # a probe's default timeout


@dataclass(frozen=True, slots=True)
class ProbeRewrite:
    probe: dict[str, Any]  # the engine container's new readinessProbe
    repeated: EngineProbe | None  # the user's check the agent repeats; None: had none


def rewrite(container: Mapping[str, Any], agent_port: int) -> ProbeRewrite | None:
    """The engine container's probe answered by its agent on `agent_port`; None when
    its check cannot move into the agent (exec, gRPC, a port it does not name)."""
    original = container.get("readinessProbe")
    if not original:
        probe = {"httpGet": {"path": ENGINE_READY_PATH, "port": agent_port}, **_DEFAULT_TIMING}
        return ProbeRewrite(probe, None)
    repeated = _repeated(original, container)
    if repeated is None:
        return None
    timing = {k: original[k] for k in _TIMING if k in original}
    # The agent runs the user's check within the user's timeout, then answers.
    timing["timeoutSeconds"] = int(repeated.timeout_seconds) + 1
    return ProbeRewrite(
        {"httpGet": {"path": ENGINE_READY_PATH, "port": agent_port}, **timing}, repeated
    )


def _repeated(original: Mapping[str, Any], container: Mapping[str, Any]) -> EngineProbe | None:
    timeout = float(original.get("timeoutSeconds") or _KUBELET_TIMEOUT_SECONDS)
    for kind, key in (("http", "httpGet"), ("tcp", "tcpSocket")):
        handler = original.get(key)
        if handler is None:
            continue
        port = _port(handler.get("port"), container)
        if port is None:
            return None
        fields: dict[str, Any] = {"kind": kind, "port": port, "timeout_seconds": timeout}
        if handler.get("host"):
            fields["host"] = handler["host"]
        if kind == "http":
            fields["path"] = handler.get("path") or "/"
            fields["scheme"] = handler.get("scheme") or "HTTP"
            fields["headers"] = {h["name"]: h["value"] for h in handler.get("httpHeaders") or []}
        return EngineProbe.model_validate(fields)
    return None  # exec or grpc


def _port(port: object, container: Mapping[str, Any]) -> int | None:
    """A probe's port: a number, a numeric string or the name of a container port."""
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for item in container.get("ports") or []:
        if item.get("name") == port:
            return int(item["containerPort"])
    return None
