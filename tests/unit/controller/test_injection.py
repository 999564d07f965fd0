"""The injection patch, applied by a real RFC 6902 library to pods as controllers send them."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest

from tests.unit.controller.builders import pod, sync
from weightsync.agent.settings import AgentSettings
from weightsync.api import agent_env
from weightsync.api.engines import EngineOptions
from weightsync.api.v1alpha1 import Role
from weightsync.api.v1alpha1.spec import PauseMode
from weightsync.controller import names
from weightsync.controller.admission.injection import injection_patch
from weightsync.controller.admission.sidecar import AgentTemplate

TEMPLATE = AgentTemplate(
    image="agent:1", requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "4Gi"}
)


def inject(
    raw: dict[str, Any], role: Role, **sync_paths: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ops = injection_patch(
        raw,
        sync=sync(**sync_paths),
        role=role,
        inference_index=0 if role is Role.SINK else None,
        namespace="ns",
        template=TEMPLATE,
    )
    patched: dict[str, Any] = jsonpatch.JsonPatch(ops).apply(raw)
    return ops, patched


def agent_of(patched: dict[str, Any]) -> dict[str, Any]:
    agents = [c for c in patched["spec"]["initContainers"] if c["name"] == names.AGENT_CONTAINER]
    assert len(agents) == 1
    agent: dict[str, Any] = agents[0]
    return agent


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("protocol", ["RDMA", "TCP"])
def test_an_explicit_recovery_protocol_reaches_the_agent(protocol: str) -> None:
    _, patched = inject(
        pod("engine-a-abc-x1").build(), Role.SINK, spec__recovery={"protocol": protocol}
    )
    assert env_of(agent_of(patched))["WEIGHTSYNC_P2P_PROTOCOL"] == protocol


def test_sink_gets_a_native_sidecar_with_engine_settings_and_the_readiness_gate() -> None:
    _, patched = inject(pod("engine-a-abc-x1").build(), Role.SINK)
    agent = agent_of(patched)
    assert agent["command"] == ["weightsync-agent"]
    assert agent["restartPolicy"] == "Always"
    assert agent["image"] == "agent:1"
    assert agent["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"memory": "4Gi"},
    }
    assert agent["readinessProbe"]["tcpSocket"] == {"port": 8470}
    env = env_of(agent)
    assert env["WEIGHTSYNC_ROLE"] == "sink"
    assert env["WEIGHTSYNC_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["WEIGHTSYNC_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["WEIGHTSYNC_HTTP_HOST"] == "$(WEIGHTSYNC_POD_IP)"
    assert env["WEIGHTSYNC_ENGINE"] == "Reference"
    assert env["WEIGHTSYNC_ENGINE_URL"] == "http://$(WEIGHTSYNC_POD_IP):8000"
    assert env["WEIGHTSYNC_TOKEN_FILE"] == f"{names.TOKEN_DIR}/token"
    assert env["WEIGHTSYNC_DEVICE"] == "cpu"
    # Auto, spec.recovery.protocol's default, is the agent's own default and goes unwritten.
    assert "WEIGHTSYNC_P2P_PROTOCOL" not in env
    assert env["WEIGHTSYNC_HOLDER"] == "false"  # plans decide who holds
    # $(VAR) expansion only sees variables defined earlier in the list.
    order = [e["name"] for e in agent["env"]]
    assert order.index("WEIGHTSYNC_POD_IP") < order.index("WEIGHTSYNC_HTTP_HOST")
    assert patched["spec"]["readinessGates"] == [{"conditionType": names.WEIGHTS_CURRENT}]
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    assert volumes[names.SOCKET_VOLUME] == {"name": names.SOCKET_VOLUME, "emptyDir": {}}
    assert volumes[names.TOKEN_VOLUME]["secret"]["secretName"] == "sync-agent-token"
    # Readable by the non-root sidecar without a pod fsGroup; no workload container mounts it.
    assert volumes[names.TOKEN_VOLUME]["secret"]["defaultMode"] == 0o444
    assert patched["spec"]["containers"][0]["volumeMounts"] == [
        {"name": names.SOCKET_VOLUME, "mountPath": agent_env.SOCKET_DIR},
        {"name": names.SHM_VOLUME, "mountPath": agent_env.SHM_DIR},
    ]
    assert "env" not in patched["spec"]["containers"][0]  # sinks need no Publisher socket env
    assert patched["metadata"]["labels"] == {names.SYNC_LABEL: "sync", names.ROLE_LABEL: "sink"}
    annotations = patched["metadata"]["annotations"]
    assert annotations[names.INJECTED_ANNOTATION] == "sync"
    assert annotations[names.AGENT_PORT_ANNOTATION] == "8470"
    assert annotations[names.INJECTED_CONTAINERS_ANNOTATION] == "main"


def test_source_shares_the_socket_with_every_trainer_container_and_gets_no_gate() -> None:
    raw = (
        pod("trainer-0")
        .set("spec.containers", [
            {"name": "trainer", "env": [{"name": "A", "value": "1"}],
             "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
            {"name": "logger"},
        ])
        .build()
    )  # fmt: skip
    _, patched = inject(raw, Role.SOURCE)
    trainer, logger = patched["spec"]["containers"]
    assert trainer["volumeMounts"][-2:] == [
        {"name": names.SOCKET_VOLUME, "mountPath": agent_env.SOCKET_DIR},
        {"name": names.SHM_VOLUME, "mountPath": agent_env.SHM_DIR},
    ]
    assert trainer["volumeMounts"][0] == {"name": "data", "mountPath": "/data"}
    assert env_of(trainer) == {"A": "1", "WEIGHTSYNC_SOCKET": agent_env.SOCKET_PATH}
    assert env_of(logger) == {"WEIGHTSYNC_SOCKET": agent_env.SOCKET_PATH}
    assert "readinessGates" not in patched["spec"]
    env = env_of(agent_of(patched))
    assert env["WEIGHTSYNC_ROLE"] == "source"
    assert "WEIGHTSYNC_ENGINE" not in env


def test_existing_lists_and_maps_are_appended_to_not_replaced() -> None:
    raw = (
        pod("engine-a-abc-x1")
        .label("app", "engine")
        .set("metadata.annotations", {"team/owner": "rl"})
        .set("spec.initContainers", [{"name": "fetch-model"}])
        .set("spec.volumes", [{"name": "cache", "emptyDir": {}}])
        .set("spec.readinessGates", [{"conditionType": "example.com/warm"}])
        .build()
    )
    _, patched = inject(raw, Role.SINK)
    assert [c["name"] for c in patched["spec"]["initContainers"]] == [
        "fetch-model",
        names.AGENT_CONTAINER,
    ]
    assert [v["name"] for v in patched["spec"]["volumes"]] == [
        "cache",
        names.SOCKET_VOLUME,
        names.TOKEN_VOLUME,
        names.SHM_VOLUME,
    ]
    assert patched["metadata"]["labels"]["app"] == "engine"
    assert patched["metadata"]["annotations"]["team/owner"] == "rl"
    assert [g["conditionType"] for g in patched["spec"]["readinessGates"]] == [
        "example.com/warm",
        names.WEIGHTS_CURRENT,
    ]


def test_one_shared_memory_volume_sized_for_the_slots_unless_the_pod_brings_its_own() -> None:
    _, patched = inject(
        pod("engine-a-abc-x1").build(),
        Role.SINK,
        spec__transfer={"bucketSizeBytes": 256 << 20, "pipelineDepth": 2},
    )
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    # 2 slots x 2 stages x 256 MiB, and 1 GiB for NCCL and the engine.
    assert volumes[names.SHM_VOLUME]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2048Mi"}
    mounts = [m for m in agent_of(patched)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert mounts == [{"name": names.SHM_VOLUME, "mountPath": agent_env.SHM_DIR}]
    # torch's shared-memory manager socket (CPU slots read by SGLang) must be there too.
    env = {e["name"]: e.get("value") for e in agent_of(patched)["env"]}
    assert env[agent_env.TMPDIR] == agent_env.SHM_DIR

    own = pod("engine-a-abc-x2").build()
    own["spec"]["containers"][0]["volumeMounts"] = [{"name": "big", "mountPath": "/dev/shm/"}]
    _, patched = inject(own, Role.SINK)
    assert names.SHM_VOLUME not in {v["name"] for v in patched["spec"]["volumes"]}
    assert all(m["mountPath"] != "/dev/shm" for m in agent_of(patched)["volumeMounts"])


def test_the_patch_is_idempotent() -> None:
    ops, patched = inject(pod("engine-a-abc-x1").build(), Role.SINK)
    assert ops
    again = injection_patch(
        patched, sync=sync(), role=Role.SINK, inference_index=0, namespace="ns", template=TEMPLATE
    )
    assert again == []


@pytest.mark.parametrize("role", [Role.SOURCE, Role.SINK])
def test_colocated_pods_get_host_ipc_and_a_node_local_directory(role: Role) -> None:
    raw = pod("p").set("spec.affinity", {"nodeAffinity": {"x": 1}}).build()
    _, patched = inject(raw, role, spec__mode="Colocated")
    assert patched["spec"]["hostIPC"] is True
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    assert volumes[names.NODE_VOLUME]["hostPath"] == {
        "path": "/var/run/weightsync/colocated/ns/sync",
        "type": "DirectoryOrCreate",
    }
    mounts = [m["mountPath"] for m in patched["spec"]["containers"][0]["volumeMounts"]]
    assert names.NODE_DIR in mounts
    assert patched["spec"]["affinity"]["nodeAffinity"] == {"x": 1}
    affinity = patched["spec"]["affinity"].get("podAffinity")
    if role is Role.SOURCE:
        assert affinity is None
    else:
        (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"] == {
            names.SYNC_LABEL: "sync",
            names.ROLE_LABEL: "source",
        }


def engine_pod(**container: Any) -> dict[str, Any]:
    raw = pod("engine-a-abc-x1").build()
    raw["spec"]["containers"] = [
        {"name": "engine", "image": "engine:1", **container},
        {"name": "helper", "image": "helper:1", "args": ["--serve"]},
    ]
    return raw


def test_vllm_defaults_go_to_the_first_container_where_the_user_did_not_set_them() -> None:
    raw = engine_pod(
        command=["vllm", "serve", "model", "--load-format=auto"],
        args=["--port", "8000"],
        env=[{"name": "VLLM_SERVER_DEV_MODE", "value": "0"}],
    )
    _, patched = inject(raw, Role.SINK, spec__inference__0__engine="VLLM")
    engine, helper = patched["spec"]["containers"]
    assert engine["command"] == ["vllm", "serve", "model", "--load-format=auto"]
    assert engine["args"] == ["--port", "8000", "--weight-transfer-config", '{"backend": "ipc"}']
    assert env_of(engine) == {
        "VLLM_SERVER_DEV_MODE": "0",  # the user's value stands
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    assert helper["args"] == ["--serve"]
    assert "env" not in helper


def test_sglang_flags_are_added_as_args_after_a_command_without_args() -> None:
    raw = engine_pod(command=["python", "-m", "sglang.launch_server"])
    _, patched = inject(raw, Role.SINK, spec__inference__0__engine="SGLang")
    assert patched["spec"]["containers"][0]["args"] == ["--load-format", "dummy"]


def test_no_flags_without_command_or_args_and_none_for_the_reference_engine() -> None:
    _, patched = inject(engine_pod(), Role.SINK, spec__inference__0__engine="VLLM")
    engine = patched["spec"]["containers"][0]
    assert "args" not in engine  # args alone would replace the image's CMD
    assert env_of(engine)["VLLM_SERVER_DEV_MODE"] == "1"
    _, patched = inject(engine_pod(args=["--port", "8000"]), Role.SINK)
    assert patched["spec"]["containers"][0]["args"] == ["--port", "8000"]
    assert "env" not in patched["spec"]["containers"][0]


def test_sink_agent_gets_the_entry_engine_options_as_json() -> None:
    _, patched = inject(
        pod("engine-a-abc-x1").build(),
        Role.SINK,
        spec__inference__0__pauseMode="Keep",
        spec__inference__0__flushCache=False,
    )
    options = EngineOptions.model_validate_json(env_of(agent_of(patched))[agent_env.ENGINE_OPTIONS])
    assert options == EngineOptions(pause_mode=PauseMode.KEEP, flush_cache=False)
    _, trainer = inject(pod("trainer-0").build(), Role.SOURCE)
    assert agent_env.ENGINE_OPTIONS not in env_of(agent_of(trainer))


@pytest.mark.parametrize("role", [Role.SOURCE, Role.SINK])
def test_the_sidecar_gets_only_variables_of_the_agent_env_contract(role: Role) -> None:
    _, patched = inject(pod("p").build(), role)
    names_written = set(env_of(agent_of(patched)))
    assert names_written <= {*agent_env.SETTINGS, agent_env.POD_IP, agent_env.TMPDIR}
    assert agent_env.ROLE in names_written


def test_a_sink_with_a_front_serves_it_and_reaches_its_engine_on_loopback() -> None:
    _, patched = inject(
        pod("engine-a-abc-x1").build(), Role.SINK, spec__inference__0__front={"port": 8001}
    )
    agent = agent_of(patched)
    env = env_of(agent)
    assert env["WEIGHTSYNC_ENGINE_URL"] == "http://127.0.0.1:8000"
    assert env["WEIGHTSYNC_FRONT_PORT"] == "8001"
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports == {"ws-control": 8470, "ws-metrics": 9470, "ws-front": 8001}
    # The settings the webhook writes are the ones the agent accepts.
    literal = {k: v for k, v in env.items() if isinstance(v, str) and "$(" not in v}
    settings = AgentSettings.from_env({**literal, "WEIGHTSYNC_TOKEN": "t"})
    assert settings.front_port == 8001


def test_a_sink_without_a_front_has_no_front_port() -> None:
    _, patched = inject(pod("engine-a-abc-x1").build(), Role.SINK)
    agent = agent_of(patched)
    assert agent_env.FRONT_PORT not in env_of(agent)
    assert names.FRONT_PORT_NAME not in {p["name"] for p in agent["ports"]}
