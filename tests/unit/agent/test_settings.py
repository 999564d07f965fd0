"""Agent settings come from WEIGHTSYNC_* variables, typed and validated once."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from weightsync.agent.settings import AgentSettings, SettingsError
from weightsync.api import agent_env
from weightsync.api.v1alpha1 import Role


def test_from_env_reads_prefixed_fields_only() -> None:
    settings = AgentSettings.from_env(
        {
            "WEIGHTSYNC_ROLE": "sink",
            "WEIGHTSYNC_TOKEN": "t0k",
            "WEIGHTSYNC_ENGINE": "Reference",
            "WEIGHTSYNC_HTTP_PORT": "9000",
            "WEIGHTSYNC_SOME_OTHER_COMPONENT": "ignored",
            "HTTP_PORT": "1",
        }
    )
    assert settings.role == Role.SINK
    assert settings.http_port == 9000
    assert settings.bearer_token() == "t0k"
    assert settings.socket == Path("/var/run/weightsync/agent.sock")


@pytest.mark.parametrize(
    ("value", "protocol"),
    [(None, "Auto"), ("auto", "Auto"), ("Auto", "Auto"), ("tcp", "TCP"), ("RDMA", "RDMA")],
)
def test_the_p2p_protocol_defaults_to_auto(value: str | None, protocol: str) -> None:
    env = {"WEIGHTSYNC_ROLE": "source", "WEIGHTSYNC_TOKEN": "x", "WEIGHTSYNC_P2P_DEVICES": "a, b"}
    if value is not None:
        env["WEIGHTSYNC_P2P_PROTOCOL"] = value
    settings = AgentSettings.from_env(env)
    assert settings.p2p_protocol.value == protocol
    assert settings.p2p_device_names == ("a", "b")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WEIGHTSYNC_ROLE": "source"}, "WEIGHTSYNC_TOKEN"),
        (
            {"WEIGHTSYNC_ROLE": "source", "WEIGHTSYNC_TOKEN": "x", "WEIGHTSYNC_P2P_PROTOCOL": "ib"},
            "p2p_protocol",
        ),
        ({"WEIGHTSYNC_ROLE": "sink", "WEIGHTSYNC_TOKEN": "x"}, "WEIGHTSYNC_ENGINE"),
        ({"WEIGHTSYNC_ROLE": "trainer", "WEIGHTSYNC_TOKEN": "x"}, "role"),
        (
            {"WEIGHTSYNC_ROLE": "source", "WEIGHTSYNC_TOKEN": "x", "WEIGHTSYNC_HTTP_PORT": "0"},
            "http_port",
        ),
        (
            {"WEIGHTSYNC_ROLE": "source", "WEIGHTSYNC_TOKEN": "x", "WEIGHTSYNC_FRONT_PORT": "80"},
            "FRONT_PORT is for a sink",
        ),
        (
            {
                "WEIGHTSYNC_ROLE": "sink",
                "WEIGHTSYNC_TOKEN": "x",
                "WEIGHTSYNC_ENGINE": "VLLM",
                "WEIGHTSYNC_FRONT_PORT": "9470",
            },
            "FRONT_PORT must differ",
        ),
    ],
)
def test_invalid_environments(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AgentSettings.from_env(env)


def test_token_file_is_reread(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    settings = AgentSettings.from_env(
        {"WEIGHTSYNC_ROLE": "source", "WEIGHTSYNC_TOKEN_FILE": str(token_file)}
    )
    assert settings.bearer_token() == "first"
    token_file.write_text("second")
    assert settings.bearer_token() == "second"
    token_file.write_text("  \n")
    with pytest.raises(SettingsError, match="empty"):
        settings.bearer_token()


def test_every_variable_the_webhook_writes_is_a_setting_the_agent_reads() -> None:
    """The environment contract is one list (`api.agent_env`): each of its settings
    variables names an AgentSettings field, and the only other one is the pod IP they expand."""
    fields = {agent_env.env_name(name) for name in AgentSettings.model_fields}
    assert set(agent_env.SETTINGS) <= fields
    assert agent_env.POD_IP not in fields  # expanded by the others, never read


@pytest.mark.parametrize(
    ("http_host", "p2p_host", "pod_ip", "p2p"),
    [
        ("10.1.2.3", None, "10.1.2.3", "10.1.2.3"),
        ("10.1.2.3", "10.9.9.9", "10.1.2.3", "10.9.9.9"),
        ("10.1.2.3", "0.0.0.0", "10.1.2.3", "10.1.2.3"),
    ],
)
def test_the_pod_ip_is_the_control_apis_host(
    http_host: str, p2p_host: str | None, pod_ip: str, p2p: str
) -> None:
    settings = AgentSettings(role=Role.SOURCE, token="t", http_host=http_host, p2p_host=p2p_host)
    assert settings.pod_ip() == pod_ip
    assert settings.p2p_address() == p2p
