"""The engine container's readiness probe, answered by its agent (`admission.engine_probe`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.controller.builders import pod
from tests.unit.controller.test_injection import agent_of, env_of, inject
from weightsync.agent.settings import AgentSettings
from weightsync.api import agent_env
from weightsync.api.engine_probe import ENGINE_READY_PATH, EngineProbe
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names

ANSWERED = {"httpGet": {"path": ENGINE_READY_PATH, "port": 8470}}


def engine(**fields: Any) -> dict[str, Any]:
    return {"name": "vllm", "image": "vllm:1", **fields}


def patched_with(container: dict[str, Any], **sync_paths: Any) -> dict[str, Any]:
    raw = pod("engine-a-abc-x1").set("spec.containers", [container, {"name": "logs"}]).build()
    return inject(raw, Role.SINK, **sync_paths)[1]


def repeated(patched: dict[str, Any]) -> EngineProbe | None:
    value = env_of(agent_of(patched)).get(agent_env.ENGINE_PROBE)
    return EngineProbe.model_validate_json(value) if value is not None else None


def test_an_http_check_moves_into_the_agent_which_answers_the_kubelet() -> None:
    """The user's check and timing stay; the kubelet asks the agent, which repeats it."""
    check = {
        "httpGet": {"path": "/health", "port": "http", "scheme": "HTTPS",
                    "httpHeaders": [{"name": "X-Probe", "value": "1"}]},
        "periodSeconds": 5, "failureThreshold": 30, "timeoutSeconds": 3,
    }  # fmt: skip
    container = engine(ports=[{"name": "http", "containerPort": 8000}], readinessProbe=check)
    patched = patched_with(container)
    probe = patched["spec"]["containers"][0]["readinessProbe"]
    assert probe == {**ANSWERED, "periodSeconds": 5, "failureThreshold": 30, "timeoutSeconds": 4}
    assert repeated(patched) == EngineProbe(
        kind="http", port=8000, path="/health", scheme="HTTPS", headers={"X-Probe": "1"},
        timeout_seconds=3.0,
    )  # fmt: skip
    annotations = patched["metadata"]["annotations"]
    assert annotations[names.ENGINE_READINESS_ANNOTATION] == "vllm"
    assert "readinessProbe" not in patched["spec"]["containers"][1]  # only the engine's
    # The agent reads what the webhook wrote.
    settings = AgentSettings.from_env({
        e["name"]: e["value"] for e in agent_of(patched)["env"] if "value" in e
    } | {agent_env.TOKEN_FILE: "/t"})  # fmt: skip
    assert settings.engine_probe == repeated(patched)


def test_a_tcp_check_and_no_check_at_all() -> None:
    patched = patched_with(engine(readinessProbe={"tcpSocket": {"port": 30000}}))
    assert patched["spec"]["containers"][0]["readinessProbe"] == {**ANSWERED, "timeoutSeconds": 2}
    assert repeated(patched) == EngineProbe(kind="tcp", port=30000)
    patched = patched_with(engine())  # no probe: ready when healthy and not behind
    probe = patched["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"] == ANSWERED["httpGet"]
    assert repeated(patched) is None
    assert names.ENGINE_READINESS_ANNOTATION in patched["metadata"]["annotations"]


@pytest.mark.parametrize(
    "check",
    [
        {"exec": {"command": ["true"]}},
        {"grpc": {"port": 9000}},
        {"httpGet": {"path": "/health", "port": "no-such-port"}},
    ],
)
def test_a_check_the_agent_cannot_repeat_is_left_as_it_is(check: dict[str, Any]) -> None:
    patched = patched_with(engine(readinessProbe=check))
    assert patched["spec"]["containers"][0]["readinessProbe"] == check
    assert repeated(patched) is None
    assert names.ENGINE_READINESS_ANNOTATION not in patched["metadata"]["annotations"]


def test_without_the_gate_the_engine_keeps_its_own_probe() -> None:
    check = {"httpGet": {"path": "/health", "port": 8000}}
    patched = patched_with(engine(readinessProbe=check), spec__readinessGate={"enabled": False})
    assert patched["spec"]["containers"][0]["readinessProbe"] == check
    assert names.ENGINE_READINESS_ANNOTATION not in patched["metadata"]["annotations"]


def test_trainer_pods_keep_their_probes() -> None:
    check = {"httpGet": {"path": "/health", "port": 8000}}
    raw = pod("trainer-0").set("spec.containers", [engine(readinessProbe=check)]).build()
    _, patched = inject(raw, Role.SOURCE)
    assert patched["spec"]["containers"][0]["readinessProbe"] == check
