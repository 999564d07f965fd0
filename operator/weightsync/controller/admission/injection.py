"""The agent sidecar as a JSON patch (RFC 6902) on a pod being created. Pure.

What a selected pod gets:
* a native sidecar `weightsync-agent` (an init container with `restartPolicy: Always`,
  Kubernetes >= 1.29; built by `sidecar.py`): it starts before the workload's
  containers, so the trainer's Publisher finds its socket, and it stops after them.
  Command `weightsync-agent`, settings as `WEIGHTSYNC_*` env (role, pod name and IP from
  the downward API, the control API bound to the pod IP, the token as a file from the
  per-WeightSync Secret, the Publisher socket, the device, and for sinks the engine and
  its URL `http://$(WEIGHTSYNC_POD_IP):<port>`, or `http://127.0.0.1:<port>` and the
  front's port behind a `front`), its ports, resources, the workload
  containers' ResourceClaims (its GPUs are theirs: `gpu_access`; a pod whose GPUs come
  from a device plugin cannot share them and is refused), and a TCP readiness probe on
  the control port (the control API has no unauthenticated route);
* an emptyDir `weightsync-socket` at `/var/run/weightsync`, mounted into the sidecar and
  every workload container (trainer containers also get `WEIGHTSYNC_SOCKET`);
* the token Secret as a read-only volume (a file, so rotation needs no restart; the
  kubelet waits for the Secret if the reconcile has not created it yet), mounted into the
  sidecar only, mode 0444: secret files are owned by root unless the pod sets an
  `fsGroup`, which would change every volume of the user's containers, and the sidecar
  runs as a non-root user;
* unless a container already mounts something there (or the pod uses the host's IPC
  namespace, Colocated), a memory-backed emptyDir at `/dev/shm` in the sidecar and every
  workload container, sized by `shm_size_limit`: the agent's CPU bucket slots live there
  and the engine maps them by name (one /dev/shm for the pod), and NCCL keeps its host
  buffers there; a container's own /dev/shm is 64 MiB;
* on inference pods with `spec.readinessGate.enabled`, the readiness gate
  `weightsync.io/weights-current`, and the engine container's readiness probe answered
  by its agent (`engine_probe`: ready only with what the agent loaded into it; annotation
  `weightsync.io/engine-readiness-by-agent`);
* on inference pods, the engine's default flags and environment
  (`weightsync.api.engines.INJECTIONS`) on the engine container, which is the pod's
  first container (the sidecar is an init container; put the engine first in a pod with
  several). A flag goes in only if neither its `command` nor its `args` name it (`--x`
  or `--x=...`), an env var only if the container does not set it. Flags are added only
  to a container that sets `command` or `args`: `args` alone would replace the image's
  CMD. The sink agent gets the entry's `pauseMode` and `flushCache` as JSON in
  `WEIGHTSYNC_ENGINE_OPTIONS`. With `spec.colocated.memoryRelease` other than None, the
  flag that lets the engine free memory (vLLM `--enable-sleep-mode`, SGLang
  `--enable-memory-saver`) goes in the same way, and a pod whose engine command line
  cannot take it (no command or args, a shell script without it, the flag turned off)
  is refused, naming the field (`engine_sleep`);
* labels `weightsync.io/sync` and `weightsync.io/role`, and annotations recording
  what was injected (`weightsync.io/injected`, `agent-port`, `agent-device`,
  `injected-into`, and on trainer pods `ranks-per-pod`, `agent-local-ranks`).

A trainer pod running several ranks (`trainer_ranks`) gets one sidecar serving each of
its source ranks with an agent process (`WEIGHTSYNC_LOCAL_RANKS`): local rank i on
`cuda:i`, ports `ws-control-i`/`ws-metrics-i` at the base ports + i, sockets from the
template `agent-{local_rank}.sock`, which trainer containers get as `WEIGHTSYNC_SOCKET`
(the Publisher completes it from torchrun's `LOCAL_RANK`).

Colocated mode adds what cross-pod CUDA IPC needs: `hostIPC: true` on both pods
(CUDA IPC handles are opened through the host's IPC namespace), a hostPath directory
`/var/run/weightsync/colocated/<namespace>/<name>` mounted at
`/var/run/weightsync-node` in both pods (a node-local rendezvous for sockets), and on
the inference pod a required pod affinity to the WeightSync's source pod on the same
node (`kubernetes.io/hostname`), so the engine lands on the trainer's GPUs.

A pod that already has a `weightsync-agent` container gets an empty patch: the
mutation is idempotent (the API server may call a webhook twice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.api import agent_env
from weightsync.api.engines import INJECTIONS
from weightsync.api.v1alpha1 import Role, SyncMode, WeightSync
from weightsync.api.v1alpha1.colocated import MemoryRelease
from weightsync.controller import names
from weightsync.controller.admission.engine_probe import rewrite
from weightsync.controller.admission.engine_sleep import release_args
from weightsync.controller.admission.gpu_access import gpu_access
from weightsync.controller.admission.patches import JsonPatch, add_to_map, append_to
from weightsync.controller.admission.sidecar import AgentTemplate, agent_container
from weightsync.controller.membership.trainer_ranks import ServedRanks
from weightsync.controller.membership.workloads import has_agent

GiB = 1 << 30


def shm_size_limit(sync: WeightSync) -> str:
    """The `/dev/shm` size for a WeightSync's pods, as a quantity.

    Two bucket slots' worth per pipeline stage (a tensor larger than the bucket size
    widens every slot to it), plus 1 GiB for NCCL's and the engine's own segments. A
    memory-backed volume takes memory only as it is written; the agent checks the free
    space before it allocates slots and says what it needs.
    """
    transfer = sync.spec.transfer
    total = 2 * transfer.pipeline_depth * transfer.bucket_size_bytes + GiB
    return f"{-(-total // (1 << 20))}Mi"


def _mounts_shm(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    return any(
        m.get("mountPath", "").rstrip("/") == agent_env.SHM_DIR
        for c in containers
        for m in c.get("volumeMounts") or []
    )


def _volumes(sync: WeightSync, namespace: str, *, shm: bool) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": names.SOCKET_VOLUME, "emptyDir": {}},
        {
            "name": names.TOKEN_VOLUME,
            "secret": {
                "secretName": names.token_secret_name(sync.metadata.name or ""),
                "items": [{"key": names.TOKEN_KEY, "path": names.TOKEN_KEY}],
                # Root-owned without an fsGroup; only the (non-root) sidecar mounts it.
                "defaultMode": 0o444,
            },
        },
    ]
    if shm:
        volumes.append(
            {
                "name": names.SHM_VOLUME,
                "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(sync)},
            }
        )
    if sync.spec.mode is SyncMode.COLOCATED:
        host_dir = names.node_host_dir(namespace, sync.metadata.name or "")
        volumes.append(
            {"name": names.NODE_VOLUME, "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}}
        )
    return volumes


def _container_ops(
    ops: JsonPatch,
    index: int,
    container: Mapping[str, Any],
    role: Role,
    *,
    colocated: bool,
    shm: bool,
    socket: str = agent_env.SOCKET_PATH,
) -> None:
    base = f"/spec/containers/{index}"
    mounted_paths = {m.get("mountPath") for m in container.get("volumeMounts") or []}
    mounts = []
    if agent_env.SOCKET_DIR not in mounted_paths:
        mounts.append({"name": names.SOCKET_VOLUME, "mountPath": agent_env.SOCKET_DIR})
    if colocated and names.NODE_DIR not in mounted_paths:
        mounts.append({"name": names.NODE_VOLUME, "mountPath": names.NODE_DIR})
    if shm:
        mounts.append({"name": names.SHM_VOLUME, "mountPath": agent_env.SHM_DIR})
    append_to(ops, container, f"{base}/volumeMounts", mounts)
    env_names = {e.get("name") for e in container.get("env") or []}
    if role is Role.SOURCE and agent_env.SOCKET not in env_names:
        append_to(
            ops,
            container,
            f"{base}/env",
            [{"name": agent_env.SOCKET, "value": socket}],
        )


def engine_defaults_ops(
    ops: JsonPatch,
    container: Mapping[str, Any],
    engine: str,
    index: int = 0,
    release: MemoryRelease = MemoryRelease.NONE,
) -> None:
    """Append the engine's default flags and env the user has not set to `container`, and
    the flag that lets it free memory as `release` asks (`engine_sleep`: raises
    `EngineCannotSleepError` where it cannot be added)."""
    injection = INJECTIONS.get(engine)
    if injection is None:
        return
    base = f"/spec/containers/{index}"
    sleep = release_args(container, injection, release, engine=engine, index=index)
    command = [str(a) for a in container.get("command") or []]
    args = [str(a) for a in container.get("args") or []]
    if command or args:
        merged = injection.merged_args([*command, *args])
        append_to(ops, container, f"{base}/args", [*merged[len(command) + len(args) :], *sleep])
    present = {e.get("name") for e in container.get("env") or []}
    env = [
        {"name": name, "value": value}
        for name, value in injection.env.items()
        if name not in present
    ]
    append_to(ops, container, f"{base}/env", env)


def _colocated_affinity(ops: JsonPatch, spec: Mapping[str, Any], sync_name: str) -> None:
    term = {
        "labelSelector": {
            "matchLabels": {
                names.SYNC_LABEL: names.sync_label(sync_name),
                names.ROLE_LABEL: Role.SOURCE.label,
            }
        },
        "topologyKey": "kubernetes.io/hostname",
    }
    affinity = spec.get("affinity") or {}
    pod_affinity = affinity.get("podAffinity") or {}
    if not affinity:
        ops.append(
            {
                "op": "add",
                "path": "/spec/affinity",
                "value": {
                    "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
                },
            }
        )
    elif not pod_affinity:
        ops.append(
            {
                "op": "add",
                "path": "/spec/affinity/podAffinity",
                "value": {"requiredDuringSchedulingIgnoredDuringExecution": [term]},
            }
        )
    else:
        append_to(
            ops,
            pod_affinity,
            "/spec/affinity/podAffinity/requiredDuringSchedulingIgnoredDuringExecution",
            [term],
        )


def injection_patch(
    pod: Mapping[str, Any],
    *,
    sync: WeightSync,
    role: Role,
    inference_index: int | None,
    namespace: str,
    template: AgentTemplate,
    served: ServedRanks | None = None,
) -> JsonPatch:
    """The JSON patch that injects the agent into `pod`; empty if it already has one.
    `served`: a trainer pod's ranks (`trainer_ranks.served_ranks`). Raises
    `GpusNotShareableError` for a pod whose GPUs its sidecar cannot be given, and
    `EngineCannotSleepError` for an engine that could not free memory as asked."""
    if has_agent(pod):
        return []
    sync_name = sync.metadata.name or ""
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    access = gpu_access(pod, sync.spec.agent.claims)  # raises GpusNotShareableError
    colocated = sync.spec.mode is SyncMode.COLOCATED
    containers = spec.get("containers") or []
    gated = role is Role.SINK and sync.spec.readiness_gate.enabled
    probe = rewrite(containers[0], template.http_port) if gated and containers else None
    ops: JsonPatch = []
    if "metadata" not in pod:
        ops.append({"op": "add", "path": "/metadata", "value": {}})
    add_to_map(
        ops,
        meta,
        "/metadata/labels",
        {names.SYNC_LABEL: names.sync_label(sync_name), names.ROLE_LABEL: role.label},
    )
    add_to_map(
        ops,
        meta,
        "/metadata/annotations",
        {
            names.INJECTED_ANNOTATION: sync_name,
            names.AGENT_PORT_ANNOTATION: str(template.http_port),
            names.AGENT_DEVICE_ANNOTATION: access.device,
            names.INJECTED_CONTAINERS_ANNOTATION: ",".join(c["name"] for c in containers),
            **(served.annotations() if served is not None else {}),
            **({names.ENGINE_READINESS_ANNOTATION: containers[0]["name"]} if probe else {}),
        },
    )
    shm = not colocated and not spec.get("hostIPC") and not _mounts_shm(pod)
    append_to(ops, spec, "/spec/volumes", _volumes(sync, namespace, shm=shm))
    agent = agent_container(
        sync,
        role,
        inference_index,
        access.device,
        template,
        shm=shm,
        served=served,
        claims=access.claims,
    )
    if probe is not None and probe.repeated is not None:
        agent["env"].append(
            {"name": agent_env.ENGINE_PROBE, "value": probe.repeated.model_dump_json()}
        )
    append_to(ops, spec, "/spec/initContainers", [agent])
    several = served is not None and served.per_pod > 1
    socket = agent_env.SOCKET_TEMPLATE if several else agent_env.SOCKET_PATH
    for index, container in enumerate(containers):
        _container_ops(ops, index, container, role, colocated=colocated, shm=shm, socket=socket)
    if role is Role.SINK and inference_index is not None and containers:
        engine = sync.spec.inference[inference_index].engine.value
        colocated_spec = sync.spec.colocated
        release = colocated_spec.memory_release if colocated_spec else MemoryRelease.NONE
        engine_defaults_ops(ops, containers[0], engine, release=release)
    if probe is not None:  # the engine is ready only with what its agent loaded
        ops.append({"op": "add", "path": "/spec/containers/0/readinessProbe", "value": probe.probe})
    if gated:
        gates = [g.get("conditionType") for g in spec.get("readinessGates") or []]
        if names.WEIGHTS_CURRENT not in gates:
            append_to(ops, spec, "/spec/readinessGates", [{"conditionType": names.WEIGHTS_CURRENT}])
    if colocated:
        ops.append({"op": "add", "path": "/spec/hostIPC", "value": True})
        if role is Role.SINK:
            _colocated_affinity(ops, spec, sync_name)
    return ops
