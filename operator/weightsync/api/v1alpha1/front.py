"""`spec.inference[].front`: the agent's filtering front for an engine's public port.

An engine's weight-update, development and memory routes share its public port with
inference, so no NetworkPolicy can keep them to the pod's own agent. With a front, the
engine listens on the pod's loopback only, the agent reaches it there, and the agent
serves the engine's clients on `front.port`, forwarding everything but those routes
(`weightsync.api.engines.PRIVATE_ROUTES`).
"""

from __future__ import annotations

from pydantic import Field

from weightsync.api.base import ApiModel
from weightsync.api.cel import CelRule

FRONT_NOT_ENGINE_PORT = CelRule(
    rule="!has(self.front) || self.front.port != self.port",
    message="front.port must differ from port: the engine listens on port on the pod's"
    " loopback, the agent's front on front.port on every interface",
    field_path=".front.port",
)
# The trainer's agent loads a Colocated engine from its own pod, through the engine's
# port on the engine pod's IP, which a front closes.
COLOCATED_NO_FRONT = CelRule(
    rule="self.mode != 'Colocated' || !has(self.inference) || self.inference.all(e, !has(e.front))",
    message="front is not supported in Colocated mode: the trainer's agent loads the engine"
    " from another pod, through the engine's port",
    field_path=".inference",
)


class FrontSpec(ApiModel):
    """The agent's filtering front for an engine's public port."""

    port: int = Field(strict=True, ge=1, le=65535)
    """port is where the agent sidecar serves the engine's clients, on every interface of
    the pod; point the engine's Service and probes here. The agent forwards each request
    to the engine on the pod's loopback and answers 403 to the engine's weight-update,
    development and memory routes, which only the agent itself calls. It must differ from
    the engine's port and from the agent's own ports (8470 and 9470 unless the operator
    is configured otherwise)."""
