"""The agent sidecar container the webhook injects (`injection.py` places it). Pure.

Its settings are `WEIGHTSYNC_*` env (the operator's), then the chart's `agent.env` and the
WeightSync's `spec.agent.env` (the fabric's: NCCL, RDMA, EFA). Its resources are the
chart's merged with `spec.agent.resources`, plus the ResourceClaims that give it its
workload's GPUs (`gpu_access`) and those `spec.agent.claims` adds. Its security context
meets Pod Security "restricted" (non-root, no privilege escalation, every capability
dropped, the runtime's default seccomp profile) unless `spec.agent.ipcLock` adds
IPC_LOCK, which RDMA's memory registration needs. `FallbackToLogsOnError`: an agent that
exits at start (a GPU it cannot see, a bad setting) says why in the pod's status.

A sink whose entry has a `front` reaches its engine on the pod's loopback and serves
the engine's clients on `front.port` (container port `ws-front`), less the engine's
private routes (`agent.front`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.api import agent_env
from weightsync.api.engines import EngineOptions
from weightsync.api.v1alpha1 import RecoveryProtocol, Role, SyncMode, WeightSync
from weightsync.api.v1alpha1.agent import RESERVED_ENV_PREFIX
from weightsync.controller import names
from weightsync.controller.membership.trainer_ranks import ServedRanks


@dataclass(frozen=True, slots=True)
class AgentTemplate:
    """The operator-wide parts of the sidecar (from `OperatorSettings`)."""

    image: str
    pull_policy: str = "IfNotPresent"
    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)
    http_port: int = agent_env.DEFAULT_HTTP_PORT
    metrics_port: int = agent_env.DEFAULT_METRICS_PORT
    log_level: str = "INFO"
    env: Sequence[Mapping[str, str]] = ()  # the chart's `agent.env`: literal values


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def agent_container(
    sync: WeightSync,
    role: Role,
    inference_index: int | None,
    device: str,
    template: AgentTemplate,
    *,
    shm: bool = False,
    served: ServedRanks | None = None,
    claims: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The sidecar container (a restartable init container); `shm`: mount the pod's
    shared-memory volume at /dev/shm; `served`: a trainer pod of several ranks, whose
    local source ranks the sidecar serves with an agent process each; `claims`: its
    resources.claims (`gpu_access`)."""
    locals_ = served.local if served is not None and served.per_pod > 1 else (0,)
    front_port: int | None = None
    env: list[dict[str, Any]] = [
        {"name": agent_env.ROLE, "value": role.label},
        _field_env(agent_env.POD_NAME, "metadata.name"),
        _field_env(agent_env.POD_IP, "status.podIP"),
        {"name": agent_env.HTTP_HOST, "value": f"$({agent_env.POD_IP})"},
        {"name": agent_env.HTTP_PORT, "value": str(template.http_port)},
        {"name": agent_env.METRICS_PORT, "value": str(template.metrics_port)},
        {"name": agent_env.TOKEN_FILE, "value": f"{names.TOKEN_DIR}/{names.TOKEN_KEY}"},
        {"name": agent_env.SOCKET, "value": agent_env.SOCKET_PATH},
        {"name": agent_env.DEVICE, "value": device},
        {"name": agent_env.LOG_LEVEL, "value": template.log_level},
        # Who holds is the plans' business (`plan.holder_ranks`): none when recovery is
        # off; in a Colocated group the source alone (it reloads its engine from it).
        {"name": agent_env.HOLDER, "value": "false"},
    ]
    protocol = sync.spec.recovery.protocol
    if protocol is not RecoveryProtocol.AUTO:
        # What holders serve and pulls use. Auto is the agent's default and goes unwritten,
        # so an agent image older than Auto (which would refuse the value) uses TCP.
        env.append({"name": agent_env.P2P_PROTOCOL, "value": protocol.value})
    if served is not None and served.per_pod > 1:
        local_ranks = ",".join(str(i) for i in served.local)
        _set_env(env, agent_env.SOCKET, agent_env.SOCKET_TEMPLATE)
        env.append({"name": agent_env.LOCAL_RANKS, "value": local_ranks})
    if role is Role.SINK and inference_index is not None:
        entry = sync.spec.inference[inference_index]
        env.append({"name": agent_env.ENGINE, "value": entry.engine.value})
        # Behind a front the engine listens on the pod's loopback only.
        host = "127.0.0.1" if entry.front is not None else f"$({agent_env.POD_IP})"
        env.append({"name": agent_env.ENGINE_URL, "value": f"http://{host}:{entry.port}"})
        if entry.front is not None:
            env.append({"name": agent_env.FRONT_PORT, "value": str(entry.front.port)})
            front_port = entry.front.port
        options = EngineOptions.of(entry)
        env.append({"name": agent_env.ENGINE_OPTIONS, "value": options.model_dump_json()})
        if sync.spec.mode is SyncMode.COLOCATED:  # the trainer's agent loads its engine
            env.append({"name": agent_env.ENGINE_LOADED_BY_PEER, "value": "true"})
    mounts: list[dict[str, Any]] = [
        {"name": names.SOCKET_VOLUME, "mountPath": agent_env.SOCKET_DIR},
        {"name": names.TOKEN_VOLUME, "mountPath": names.TOKEN_DIR, "readOnly": True},
    ]
    if sync.spec.mode is SyncMode.COLOCATED:
        mounts.append({"name": names.NODE_VOLUME, "mountPath": names.NODE_DIR})
    if shm:
        mounts.append({"name": names.SHM_VOLUME, "mountPath": agent_env.SHM_DIR})
        # CPU slots reach an engine (SGLang) as torch file-system shared memory, whose
        # reader registers with the agent's torch_shm_manager through a socket under
        # TMPDIR: in the default /tmp, another container cannot reach it and the engine's
        # load fails; /dev/shm is the one directory the pod's containers share.
        env.append({"name": agent_env.TMPDIR, "value": agent_env.SHM_DIR})
    ports = []
    for local in locals_:  # named by local rank past the first (a name has <= 15 chars)
        suffix = f"-{local}" if local else ""
        port = template.http_port + local
        ports.append({"name": f"ws-control{suffix}", "containerPort": port, "protocol": "TCP"})
        if template.metrics_port:
            port = template.metrics_port + local
            ports.append({"name": f"ws-metrics{suffix}", "containerPort": port, "protocol": "TCP"})
    if front_port is not None:  # the engine's clients come here (a Service's targetPort)
        ports.append(
            {"name": names.FRONT_PORT_NAME, "containerPort": front_port, "protocol": "TCP"}
        )
    extra = sync.spec.agent
    env.extend(_fabric_env(env, [*template.env, *(e.to_k8s() for e in extra.env)]))
    mounts.extend(m.to_k8s() for m in extra.volume_mounts)
    resources = _resources(template, sync, claims)
    return {
        "name": names.AGENT_CONTAINER,
        "image": template.image,
        "imagePullPolicy": template.pull_policy,
        "command": list(names.AGENT_COMMAND),
        "restartPolicy": "Always",
        "env": env,
        "ports": ports,
        "volumeMounts": mounts,
        "resources": resources,
        # Every second: an agent restarted in place is listening ~3 s after its start, and
        # the pod event of its Ready brings the pass that asks it (a probe every 5 s cost
        # up to 4 s a restart; a TCP connect costs the kubelet next to nothing).
        "readinessProbe": {
            "tcpSocket": {"port": template.http_port + locals_[0]},
            "periodSeconds": 1,
            "failureThreshold": 3,
        },
        "securityContext": security_context(["IPC_LOCK"] if extra.ipc_lock else []),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def sink_agent_ports(template: AgentTemplate) -> dict[int, str]:
    """The ports a sink's agent listens on itself, by number, with what each is for."""
    ports = {template.http_port: "the agent's control port"}
    if template.metrics_port:
        ports[template.metrics_port] = "the agent's metrics port"
    return ports


def security_context(capabilities: Sequence[str] = ()) -> dict[str, Any]:
    """Pod Security "restricted" for a container, plus `capabilities` (IPC_LOCK at most)."""
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if capabilities:
        context["capabilities"]["add"] = list(capabilities)
    return context


def _fabric_env(
    own: Sequence[Mapping[str, Any]], added: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`added` (the chart's, then the WeightSync's) after the operator's `own`: never one
    of the operator's names, and a name given twice keeps its last value."""
    taken = {item["name"] for item in own}
    last: dict[str, dict[str, Any]] = {}
    for item in added:
        if item["name"] not in taken and not str(item["name"]).startswith(RESERVED_ENV_PREFIX):
            last[item["name"]] = {"name": item["name"], "value": str(item.get("value", ""))}
    return list(last.values())


def _resources(
    template: AgentTemplate, sync: WeightSync, claims: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    wanted = sync.spec.agent.resources
    resources: dict[str, Any] = {}
    requests = {**template.requests, **wanted.requests}
    limits = {**template.limits, **wanted.limits}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    if claims:
        resources["claims"] = [dict(claim) for claim in claims]
    return resources


def _set_env(env: list[dict[str, Any]], name: str, value: str) -> None:
    for item in env:
        if item["name"] == name:
            item["value"] = value
