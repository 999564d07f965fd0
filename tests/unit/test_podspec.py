"""The pod runner's kubelet imitation: env, downward API, expansion, volumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cluster import podspec


class FakeReader:
    """In-memory ConfigMaps and Secrets: the reads podspec needs, without an API server."""

    def config_map(self, namespace: str, name: str) -> dict[str, str]:
        return {"mode": "fast", "ca.crt": "CA"} if name == "settings" else {}

    def secret(self, namespace: str, name: str) -> dict[str, str]:
        return {"token": "s3cret"}

    def service_account_token(
        self, namespace: str, service_account: str, pod: dict[str, Any]
    ) -> str:
        return f"token-for-{namespace}/{service_account}"

    def ca_certificate(self) -> str:
        return "CA"


POD: dict[str, Any] = {
    "metadata": {"name": "engine-0", "namespace": "rl", "uid": "u1", "labels": {"role": "sink"}},
    "spec": {
        "nodeName": "gpu-node-1",
        "volumes": [
            {"name": "sock", "emptyDir": {}},
            {"name": "node", "hostPath": {"path": "/var/run/weightsync"}},
            {
                "name": "api",
                "projected": {
                    "sources": [
                        {"serviceAccountToken": {"path": "token"}},
                        {
                            "configMap": {
                                "name": "settings",
                                "items": [{"key": "ca.crt", "path": "ca.crt"}],
                            }
                        },
                        {
                            "downwardAPI": {
                                "items": [
                                    {
                                        "path": "namespace",
                                        "fieldRef": {"fieldPath": "metadata.namespace"},
                                    }
                                ]
                            }
                        },
                    ]
                },
            },
        ],
    },
    "status": {"podIP": "127.1.2.3", "hostIP": "127.0.2.1"},
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--host=$(POD_IP)", "--host=127.1.2.3"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(POD_IP)", "$(POD_IP)"),
    ],
)
def test_expand_follows_kubernetes_rules(text: str, expected: str) -> None:
    assert podspec.expand(text, {"POD_IP": "127.1.2.3"}) == expected


def test_field_values_cover_downward_api() -> None:
    assert podspec.field_value(POD, "status.podIP") == "127.1.2.3"
    assert podspec.field_value(POD, "metadata.labels['role']") == "sink"
    with pytest.raises(podspec.PodSpecError, match="not supported"):
        podspec.field_value(POD, "spec.containers[0]")


def test_env_resolves_references_in_order() -> None:
    container = {
        "name": "agent",
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "URL", "value": "http://$(POD_IP):9000"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "agent", "key": "token"}}},
            {"name": "EMPTY"},
        ],
    }
    env = podspec.container_env(container, POD, FakeReader(), {"PATH": "/bin"})
    assert env["URL"] == "http://127.1.2.3:9000"
    assert env["TOKEN"] == "s3cret"
    assert env["EMPTY"] == ""
    assert env["CFG_mode"] == "fast"
    assert env["PATH"] == "/bin"


def test_volumes_are_per_pod_except_host_paths_which_are_per_node(tmp_path: Path) -> None:
    volumes = podspec.materialise_volumes(POD, tmp_path / "pod", tmp_path / "node", FakeReader())
    assert volumes["sock"] == tmp_path / "pod" / "volumes" / "sock"
    assert volumes["node"] == tmp_path / "node" / "hostpath" / "var/run/weightsync"
    assert (volumes["api"] / "token").read_text() == "token-for-rl/default"
    assert (volumes["api"] / "namespace").read_text() == "rl"
    assert (volumes["api"] / "ca.crt").read_text() == "CA"


def test_launch_needs_a_command_and_expands_args(tmp_path: Path) -> None:
    volumes = {"sock": tmp_path}
    container = {
        "name": "agent",
        "command": ["weightsync-agent"],
        "args": ["--host", "$(POD_IP)"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "volumeMounts": [{"name": "sock", "mountPath": "/var/run/weightsync"}],
    }
    launch = podspec.launch_spec(container, POD, volumes, FakeReader(), {})
    assert launch.argv == ["weightsync-agent", "--host", "127.1.2.3"]
    assert launch.mounts == [(tmp_path, "/var/run/weightsync")]
    with pytest.raises(podspec.PodSpecError, match="no command"):
        podspec.launch_spec({"name": "x", "image": "y"}, POD, volumes, FakeReader(), {})
