"""The agent's typed settings, read once from `WEIGHTSYNC_*` environment variables."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from weightsync.api import agent_env
from weightsync.api.engine_probe import EngineProbe
from weightsync.api.engines import EngineOptions
from weightsync.api.v1alpha1 import Engine, Role
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol

# A wildcard bind address is no address for peers.
WILDCARDS = ("0.0.0.0", "::", "")  # noqa: S104


class SettingsError(ValueError):
    """The environment does not describe a valid agent."""


class AgentSettings(BaseModel):
    """Field `foo_bar` is read from `WEIGHTSYNC_FOO_BAR`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    pod_name: str = Field(default_factory=socket.gethostname)
    http_host: str = "0.0.0.0"  # noqa: S104 - the operator reaches the agent on its pod IP
    http_port: int = Field(default=agent_env.DEFAULT_HTTP_PORT, ge=1, le=65535)
    metrics_port: int = Field(default=agent_env.DEFAULT_METRICS_PORT, ge=0, le=65535)
    token: SecretStr | None = None
    token_file: Path | None = None
    socket: Path = Path(agent_env.SOCKET_PATH)  # the Publisher's Unix socket (source role)
    device: str = "cpu"  # "cpu" or "cuda:N": where the bucket slots live
    # A sink: how many devices its engine reads from (a tensor-parallel engine's workers),
    # a copy of each slot on each; unset: every visible GPU from `device` on, one on CPU.
    engine_devices: int | None = Field(default=None, ge=1)
    shm_dir: Path = Path(agent_env.SHM_DIR)
    engine: Engine | None = None  # sinks, or Colocated sources
    engine_url: str = "http://127.0.0.1:30000"
    engine_timeout_seconds: float = Field(default=60.0, gt=0)
    engine_options: EngineOptions | None = None  # JSON: the entry's pauseMode, flushCache
    # Colocated inference pods: the trainer's agent loads this engine, not this agent.
    engine_loaded_by_peer: bool = False
    # JSON: the engine container's own readiness check, repeated when this agent answers
    # the engine's probe (`agent.engine_ready`); unset: the engine's health alone.
    engine_probe: EngineProbe | None = None
    # A sink's filtering front: the port it serves the engine's clients on; 0: none.
    front_port: int = Field(default=0, ge=0, le=65535)
    log_level: str = "INFO"
    # P2P recovery. `holder`: keep the latest committed version in host memory for pulls;
    # unset, the source holds and sinks hold only when their plan says so.
    holder: bool | None = None
    # For measuring only (the benchmark's A/B of issue #40): the holder's copy of the
    # Publisher's tensors keeps queueing while a round votes (`host_copies.VoteGate`).
    measure_holder_copies_through_votes: bool = False
    p2p_host: str | None = None  # the Mooncake segment's host; defaults to `http_host`
    # What holders serve and pulls use: Auto is resolved at start (`transfer.p2p_protocol`).
    p2p_protocol: RecoveryProtocol = RecoveryProtocol.AUTO
    p2p_devices: str = ""  # RDMA NIC names, comma-separated; empty: Mooncake picks
    # A trainer pod of several ranks: the local ranks this sidecar serves, an agent
    # process each (`agent.local_ranks`); empty: this process is the one agent.
    local_ranks: str = ""

    @field_validator("p2p_protocol", mode="before")
    @classmethod
    def _upper_protocol(cls, value: object) -> object:  # `tcp` as well as the API's `TCP`
        if isinstance(value, str) and value.lower() == RecoveryProtocol.AUTO.lower():
            return RecoveryProtocol.AUTO
        return value.upper() if isinstance(value, str) else value

    @field_validator("engine_options", mode="before")
    @classmethod
    def _parse_options(cls, value: object) -> object:
        return EngineOptions.model_validate_json(value) if isinstance(value, str) else value

    @field_validator("engine_probe", mode="before")
    @classmethod
    def _parse_probe(cls, value: object) -> object:
        return EngineProbe.model_validate_json(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> AgentSettings:
        if self.token is None and self.token_file is None:
            raise ValueError("set WEIGHTSYNC_TOKEN or WEIGHTSYNC_TOKEN_FILE")
        if self.role == Role.SINK and self.engine is None:
            raise ValueError("a sink agent needs WEIGHTSYNC_ENGINE")
        if self.role != Role.SINK and self.engine_devices is not None:
            raise ValueError("WEIGHTSYNC_ENGINE_DEVICES is a sink agent's setting")
        if self.front_port and (self.role != Role.SINK or self.engine is None):
            raise ValueError("WEIGHTSYNC_FRONT_PORT is for a sink agent's engine")
        if self.front_port in (self.http_port, self.metrics_port):
            raise ValueError("WEIGHTSYNC_FRONT_PORT must differ from the agent's own ports")
        return self

    @property
    def p2p_device_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.p2p_devices.split(",") if name.strip())

    @property
    def holds_by_default(self) -> bool:
        """Whether this agent holds without a plan asking it to (the source does)."""
        return self.role == Role.SOURCE if self.holder is None else self.holder

    def pod_ip(self) -> str:
        """This pod's IP: the control API's host, which the webhook binds to it, or the
        hostname's address where the agent listens on every interface."""
        if self.http_host in WILDCARDS:
            return socket.gethostbyname(socket.gethostname())
        return self.http_host

    def p2p_address(self) -> str:
        """The host peers reach this agent's transfer engine on (its pod IP)."""
        if self.p2p_host and self.p2p_host not in WILDCARDS:
            return self.p2p_host
        return self.pod_ip()

    def bearer_token(self) -> str:
        """The control API token; a token file is re-read so rotation needs no restart."""
        if self.token_file is not None:
            token = self.token_file.read_text().strip()
        elif self.token is not None:
            token = self.token.get_secret_value()
        else:
            token = ""
        if not token:
            raise SettingsError("the control API token is empty")
        return token

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AgentSettings:
        env = os.environ if environ is None else environ
        known = set(cls.model_fields)
        values: dict[str, str] = {}
        for key, value in env.items():
            if not key.startswith(agent_env.PREFIX):
                continue
            field = key.removeprefix(agent_env.PREFIX).lower()
            if field in known:
                values[field] = value
        return cls.model_validate(values)
