"""The engine container's own readiness check, which its agent repeats when it answers
the kubelet's probe in its place: the webhook points the engine container's readiness
probe at the agent (`ENGINE_READY_PATH`), and hands the agent the check it replaced
(`agent_env.ENGINE_PROBE`, this model as JSON), so the user's check still counts.

Why the agent answers at all: the kubelet recomputes a pod's Ready from its own cached
copy of the readiness-gate condition when a container's probe passes, so an engine
restarted in place could turn its pod Ready on a gate the operator had already closed
(docs/reliability.md). A probe that passes only once the engine serves what its agent
loaded makes that copy harmless.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ENGINE_READY_PATH = "/v1/engine/ready"  # the agent's control port; no token (the kubelet's)


class EngineProbe(BaseModel):
    """An HTTP GET (success: 200-399, TLS unverified, as the kubelet does) or a TCP
    connect, on `host`; None: the pod's IP, as the kubelet would (an engine may listen
    on it alone)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["http", "tcp"]
    port: int = Field(ge=1, le=65535)
    host: str | None = None
    path: str = "/"
    scheme: Literal["HTTP", "HTTPS"] = "HTTP"
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_seconds: float = Field(default=1.0, gt=0)
