"""The agent's environment: the contract between the webhook that writes it
(`controller.injection`) and the agent that reads it (`agent.settings`: variable
`WEIGHTSYNC_FOO_BAR` is the settings field `foo_bar`). The Publisher reads `SOCKET` too."""

from __future__ import annotations

from typing import Final

PREFIX: Final = "WEIGHTSYNC_"

# Where the sidecar listens for the Publisher: an emptyDir both containers mount.
SOCKET_DIR: Final = "/var/run/weightsync"
SOCKET_PATH: Final = f"{SOCKET_DIR}/agent.sock"
# A trainer pod of several ranks: one socket per local rank, the Publisher fills in its
# LOCAL_RANK (as torchrun sets it).
SOCKET_TEMPLATE: Final = f"{SOCKET_DIR}/agent-{{local_rank}}.sock"
LOCAL_RANK_PLACEHOLDER: Final = "{local_rank}"

# The agent's ports unless the operator is configured otherwise (its AGENT_HTTP_PORT and
# AGENT_METRICS_PORT, which the webhook writes as HTTP_PORT and METRICS_PORT).
DEFAULT_HTTP_PORT: Final = 8470
DEFAULT_METRICS_PORT: Final = 9470  # 0: no metrics listener
# Where the agent's CPU bucket slots live, which the webhook mounts a memory volume on.
SHM_DIR: Final = "/dev/shm"  # noqa: S108 - POSIX shared memory, not a temp dir


def env_name(field: str) -> str:
    """The variable of the settings field `field`."""
    return PREFIX + field.upper()


ROLE: Final = env_name("role")
POD_NAME: Final = env_name("pod_name")
HTTP_HOST: Final = env_name("http_host")
HTTP_PORT: Final = env_name("http_port")
METRICS_PORT: Final = env_name("metrics_port")
TOKEN_FILE: Final = env_name("token_file")
SOCKET: Final = env_name("socket")
DEVICE: Final = env_name("device")
LOG_LEVEL: Final = env_name("log_level")
P2P_PROTOCOL: Final = env_name("p2p_protocol")
HOLDER: Final = env_name("holder")
ENGINE: Final = env_name("engine")
ENGINE_URL: Final = env_name("engine_url")
ENGINE_OPTIONS: Final = env_name("engine_options")  # JSON: the entry's EngineOptions
ENGINE_LOADED_BY_PEER: Final = env_name("engine_loaded_by_peer")
# A sink's filtering front (`spec.inference[].front.port`): where the agent serves the
# engine's clients; ENGINE_URL is then the engine on the pod's loopback.
FRONT_PORT: Final = env_name("front_port")
# JSON: the engine container's own readiness check (`api.engine_probe.EngineProbe`),
# which the agent repeats when it answers the engine's probe in its place.
ENGINE_PROBE: Final = env_name("engine_probe")
# Trainer pods of several ranks: the local ranks the sidecar serves ("0,1"), one agent
# process each (local rank i: device cuda:i, ports HTTP_PORT + i and METRICS_PORT + i).
LOCAL_RANKS: Final = env_name("local_ranks")
# Not written by the webhook (the sidecar sees exactly its engine's GPUs and serves them
# all): how many devices a sink's engine reads from, for a sidecar that sees more.
ENGINE_DEVICES: Final = env_name("engine_devices")

# Not a setting: the pod IP from the downward API, which HTTP_HOST and ENGINE_URL expand.
POD_IP: Final = env_name("pod_ip")
# Not a setting: where torch puts its shared-memory manager's socket (see injection).
TMPDIR: Final = "TMPDIR"

# Every variable the webhook may write that the agent reads as a setting.
SETTINGS: Final = (
    ROLE,
    POD_NAME,
    HTTP_HOST,
    HTTP_PORT,
    METRICS_PORT,
    TOKEN_FILE,
    SOCKET,
    DEVICE,
    LOG_LEVEL,
    P2P_PROTOCOL,
    HOLDER,
    ENGINE,
    ENGINE_URL,
    ENGINE_OPTIONS,
    ENGINE_LOADED_BY_PEER,
    FRONT_PORT,
    ENGINE_PROBE,
    LOCAL_RANKS,
)
