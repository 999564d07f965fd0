"""The real helm binary (built by tests/cluster/build) run over charts/weightsync."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.controlplane import build_binaries

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "weightsync"
RELEASE = "ws"
NAMESPACE = "weightsync-system"
MONITORING_API = "monitoring.coreos.com/v1"


@functools.cache
def helm_binary() -> Path:
    return build_binaries() / "helm"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, check=check, timeout=60
    )


def _set_args(values: tuple[tuple[str, str], ...]) -> list[str]:
    args = []
    for key, value in values:
        args += ["--set-json", f"{key}={value}"]
    return args


@functools.cache
def _render(values: tuple[tuple[str, str], ...], api_versions: tuple[str, ...]) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *_set_args(values)]
    for api in api_versions:
        args += ["--api-versions", api]
    return helm(*args).stdout


def render(
    values: dict[str, str] | None = None, api_versions: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The chart's objects. `values` map a dotted key to a JSON value (`--set-json`)."""
    text = _render(tuple(sorted((values or {}).items())), api_versions)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_error(values: dict[str, str]) -> str:
    """helm template's error output for values that must be refused."""
    args = [
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        *_set_args(tuple(values.items())),
    ]
    result = helm(*args, check=False)
    assert result.returncode != 0, f"helm accepted {values}"
    return result.stderr


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        obj
        for obj in objects
        if obj["kind"] == kind and (name is None or obj["metadata"]["name"] == name)
    ]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def kinds(objects: list[dict[str, Any]]) -> set[str]:
    return {obj["kind"] for obj in objects}


def is_hook(obj: dict[str, Any]) -> bool:
    """Whether `obj` is a Helm hook (here: the `helm test` resources)."""
    return "helm.sh/hook" in (obj["metadata"].get("annotations") or {})


def is_test(obj: dict[str, Any]) -> bool:
    """An object of `helm test` (its pod, and the ServiceAccount, roles and ConfigMap
    that are plain release objects so `helm test --logs` reads only the pod)."""
    labels = obj["metadata"].get("labels") or {}
    return labels.get("app.kubernetes.io/component") == "test"
