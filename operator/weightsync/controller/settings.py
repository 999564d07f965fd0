"""The operator's typed settings, read once at startup from `WEIGHTSYNC_OPERATOR_*`.

Field `foo_bar` is read from `WEIGHTSYNC_OPERATOR_FOO_BAR`; unknown variables with the
prefix are an error, so a typo in the chart fails at startup instead of being ignored.

Process and scope
* `NAMESPACE`                 the operator's own namespace (downward API `metadata.namespace`);
                              the managed webhook-certificate Secret lives here.
                              Default `weightsync-system`.
* `WATCH_NAMESPACES`          comma-separated namespaces to serve; empty (the default) serves
                              the whole cluster. `--namespace` on the command line wins.
* `HEALTH_PORT`               kopf's liveness endpoint, `http://0.0.0.0:<port>/healthz`.
                              Default 8080; 0 turns it off.
* `METRICS_PORT`              Prometheus metrics (`weightsync_operator_*`) on `/metrics`.
                              Default 9090; 0 turns it off.
* `LOG_LEVEL`                 DEBUG, INFO (default), WARNING, ERROR.
* `LEADER_LEASE`              the Lease in `NAMESPACE` that replicas elect a leader with:
                              every replica serves admission, only its holder reconciles
                              (docs/operator.md#high-availability). Empty (the default): no
                              election, this process reconciles at once (one replica, or
                              an operator run outside the chart).
* `IDENTITY`                  this replica's name in the Lease (`holderIdentity`); the chart
                              sets the pod's name. Default `<host name>-<process id>`.

Admission webhook
* `WEBHOOK_LISTEN_HOST`       address the HTTPS webhook server binds. Default `0.0.0.0`.
* `WEBHOOK_LISTEN_PORT`       port it binds. Default 9443.
* `WEBHOOK_URL`               URL mode: the base URL the API server calls, `https://<host>:<port>`
                              (local control planes, the demo, an operator running outside the
                              cluster). Set this or `WEBHOOK_SERVICE_NAME`, not both.
* `WEBHOOK_SERVICE_NAME`      Service mode (real clusters): the Service in front of the operator.
* `WEBHOOK_SERVICE_NAMESPACE` its namespace. Default: `NAMESPACE`.
* `WEBHOOK_SERVICE_PORT`      its port. Default 443.
* `WEBHOOK_CONFIGURATION`     name of the Mutating/ValidatingWebhookConfiguration objects the
                              operator manages (kopf's `settings.admission.managed`); also the
                              suffix of each webhook's name, so it needs a dot. Default
                              `weightsync.io`.
* `WEBHOOK_CERTS`             `managed` (default): the operator generates a CA and a serving
                              certificate and keeps them in a Secret it owns, reusing them on
                              restart; `directory`: read `tls.crt`, `tls.key` and `ca.crt`
                              from `WEBHOOK_CERT_DIR` (a cert-manager Certificate's Secret,
                              mounted), re-read when they change.
* `WEBHOOK_CERT_SECRET`       managed mode: the Secret's name. Default `weightsync-webhook-certs`.
* `WEBHOOK_CERT_DIR`          directory mode: where the certificate files are mounted.

Injected agent sidecar
* `AGENT_IMAGE`               image of the `weightsync-agent` sidecar.
* `AGENT_IMAGE_PULL_POLICY`   Always, IfNotPresent (default) or Never.
* `AGENT_CPU_REQUEST`, `AGENT_MEMORY_REQUEST`, `AGENT_CPU_LIMIT`, `AGENT_MEMORY_LIMIT`
                              the sidecar's resources; empty leaves one out. Defaults
                              `500m`, `1Gi`, none, none (pinned host copies of the weights
                              are the agent's own memory; size the limit to the model).
* `AGENT_HTTP_PORT`           the agent's control API port. Default 8470.
* `AGENT_METRICS_PORT`        the agent's metrics port. Default 9470.
* `AGENT_LOG_LEVEL`           the agents' log level. Default INFO.
* `AGENT_ENV`                 JSON list of `{"name", "value"}` added to every sidecar's env
                              (the fabric's: NCCL_IB_HCA, ...); a WeightSync's
                              `spec.agent.env` comes after it. Default [].
* `RENDEZVOUS_PORT`           the TCPStore port on the source agent's pod IP. Default 29470.

Agent control and reconcile pacing
* `TOKEN_KEY_SECRET`          the Secret in `NAMESPACE` holding the key every WeightSync's agent
                              token is derived from; created by the operator if missing.
                              Default `weightsync-token-key`.
* `AGENT_TIMEOUT_SECONDS`     timeout of one control-API request to an agent. Default 5.
* `RESYNC_SECONDS`            the drift timer: how often every WeightSync is reconciled even
                              without events (also how often every agent is polled; the
                              trainer's agents are asked every second besides). Default 5.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Final, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from weightsync.api.agent_env import DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT
from weightsync.api.v1alpha1 import EnvVar

ENV_PREFIX = "WEIGHTSYNC_OPERATOR_"


class SettingsError(ValueError):
    """The environment does not describe a valid operator."""


class CertMode(StrEnum):
    MANAGED = "managed"
    DIRECTORY = "directory"


class PullPolicy(StrEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


DEFAULT_RESYNC_SECONDS: Final = 5.0  # the drift timer's period (`gatesync` settles on it)


class OperatorSettings(BaseModel):
    """See the module docstring for each field's variable and meaning."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = "weightsync-system"
    watch_namespaces: tuple[str, ...] = ()
    health_port: int = Field(default=8080, ge=0, le=65535)
    metrics_port: int = Field(default=9090, ge=0, le=65535)
    log_level: str = "INFO"
    leader_lease: str = ""
    identity: str = ""

    webhook_listen_host: str = "0.0.0.0"  # noqa: S104 - the API server calls in from outside
    webhook_listen_port: int = Field(default=9443, ge=1, le=65535)
    webhook_url: str | None = None
    webhook_service_name: str | None = None
    webhook_service_namespace: str | None = None
    webhook_service_port: int = Field(default=443, ge=1, le=65535)
    webhook_configuration: str = "weightsync.io"
    webhook_certs: CertMode = CertMode.MANAGED
    webhook_cert_secret: str = "weightsync-webhook-certs"  # noqa: S105 - a Secret's name
    webhook_cert_dir: Path | None = None

    agent_image: str = "weightsync/agent:0.1.0"
    agent_image_pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    agent_cpu_request: str = "500m"
    agent_memory_request: str = "1Gi"
    agent_cpu_limit: str = ""
    agent_memory_limit: str = ""
    agent_http_port: int = Field(default=DEFAULT_HTTP_PORT, ge=1, le=65535)
    agent_metrics_port: int = Field(default=DEFAULT_METRICS_PORT, ge=0, le=65535)
    agent_log_level: str = "INFO"
    agent_env: tuple[EnvVar, ...] = ()
    rendezvous_port: int = Field(default=29470, ge=1, le=65535)

    token_key_secret: str = "weightsync-token-key"  # noqa: S105 - a Secret's name
    agent_timeout_seconds: float = Field(default=5.0, gt=0, le=60)
    resync_seconds: float = Field(default=DEFAULT_RESYNC_SECONDS, gt=0, le=3600)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.webhook_url is None) == (self.webhook_service_name is None):
            raise ValueError("set exactly one of WEBHOOK_URL (URL mode) and WEBHOOK_SERVICE_NAME")
        if self.webhook_url is not None:
            parts = urlsplit(self.webhook_url)
            if parts.scheme != "https" or not parts.hostname:
                raise ValueError(f"WEBHOOK_URL must be https://<host>[:<port>], not {parts!r}")
        if "." not in self.webhook_configuration.strip("."):
            # Webhook names are "<handler>.<configuration>" and need three dotted segments.
            raise ValueError("WEBHOOK_CONFIGURATION needs a dot, e.g. weightsync.io")
        if self.webhook_certs is CertMode.DIRECTORY and self.webhook_cert_dir is None:
            raise ValueError("WEBHOOK_CERTS=directory needs WEBHOOK_CERT_DIR")
        if self.agent_http_port == self.agent_metrics_port:
            raise ValueError("AGENT_HTTP_PORT and AGENT_METRICS_PORT must differ")
        return self

    @property
    def service_namespace(self) -> str:
        return self.webhook_service_namespace or self.namespace

    @property
    def webhook_host(self) -> str:
        """The host name (URL mode) or Service DNS name the serving certificate is for."""
        if self.webhook_url is not None:
            host = urlsplit(self.webhook_url).hostname
            if host is None:  # excluded by the validator; keeps mypy and readers honest
                raise SettingsError("WEBHOOK_URL has no host")
            return host
        return f"{self.webhook_service_name}.{self.service_namespace}.svc"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """Read the settings; raise SettingsError naming every bad variable."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for key, value in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            field = key.removeprefix(ENV_PREFIX).lower()
            if field not in cls.model_fields:
                raise SettingsError(f"{key} is not a weightsync operator setting")
            if field == "watch_namespaces":
                values[field] = tuple(part.strip() for part in value.split(",") if part.strip())
            elif field == "agent_env":
                try:
                    values[field] = json.loads(value or "[]")
                except json.JSONDecodeError as exc:
                    raise SettingsError(
                        f"{key}: not a JSON list of name/value pairs: {exc}"
                    ) from None
            else:
                values[field] = value
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise SettingsError(_describe(error)) from None


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"])
        name = f"{ENV_PREFIX}{where.upper()}" if where else "settings"
        lines.append(f"{name}: {item['msg']}")
    return "; ".join(lines)
