"""Turning a pod's spec into what a local process needs: argv, env and mounts.

This is the part of a kubelet the pod runner imitates: downward-API values,
ConfigMap and Secret references, `$(VAR)` expansion in command and args, and the
volumes a container mounts, materialised as directories under the pod's own
folder (hostPath volumes under the node's folder, so pods on one fake node share
them and pods on different nodes do not).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


class ClusterReader(Protocol):
    """The reads a pod's env and volumes need; `podrunner` implements it over the API."""

    def config_map(self, namespace: str, name: str) -> dict[str, str]: ...

    def secret(self, namespace: str, name: str) -> dict[str, str]: ...

    def service_account_token(
        self, namespace: str, service_account: str, pod: dict[str, Any]
    ) -> str: ...

    def ca_certificate(self) -> str: ...


class PodSpecError(ValueError):
    """The pod asks for something a local process cannot be given."""


@dataclass
class ContainerLaunch:
    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: list[tuple[Path, str]] = field(default_factory=list)  # (host dir, mount path)
    working_dir: str | None = None


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: unknown references stay as written, `$$` is `$`."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(replace, text)


def field_value(pod: dict[str, Any], path: str) -> str:
    """A downward-API `fieldRef.fieldPath` value."""
    meta, status, spec = pod["metadata"], pod.get("status", {}), pod["spec"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
    }
    if path in simple:
        return str(simple[path])
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        found = re.fullmatch(rf"{re.escape(prefix)}\['([^']+)'\]", path)
        if found:
            return str(meta.get(source, {}).get(found.group(1), ""))
    raise PodSpecError(f"fieldRef {path!r} is not supported by the local pod runner")


def _env_value(
    item: dict[str, Any], pod: dict[str, Any], reader: ClusterReader, env: dict[str, str]
) -> str | None:
    if "value" in item:
        return expand(str(item["value"]), env)
    if "valueFrom" not in item:
        return ""  # the API server drops `value: ""`; Kubernetes reads it as empty
    source = item["valueFrom"]
    namespace = pod["metadata"]["namespace"]
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"])
    for kind, read in (("configMapKeyRef", reader.config_map), ("secretKeyRef", reader.secret)):
        if kind in source:
            ref = source[kind]
            data = read(namespace, ref["name"])
            if ref["key"] not in data and not ref.get("optional"):
                raise PodSpecError(f"{kind} {ref['name']}/{ref['key']} does not exist")
            return data.get(ref["key"])
    if "resourceFieldRef" in source:
        return "0"  # no cgroup limits are enforced on local processes
    raise PodSpecError(f"env {item.get('name')}: unsupported valueFrom {sorted(source)}")


def container_env(
    container: dict[str, Any], pod: dict[str, Any], reader: ClusterReader, base: dict[str, str]
) -> dict[str, str]:
    env = dict(base)
    namespace = pod["metadata"]["namespace"]
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            env.update(
                {
                    prefix + k: v
                    for k, v in reader.config_map(namespace, source["configMapRef"]["name"]).items()
                }
            )
        if "secretRef" in source:
            env.update(
                {
                    prefix + k: v
                    for k, v in reader.secret(namespace, source["secretRef"]["name"]).items()
                }
            )
    for item in container.get("env", []):
        value = _env_value(item, pod, reader, env)
        if value is not None:
            env[item["name"]] = value
    return env


def materialise_volumes(
    pod: dict[str, Any], pod_dir: Path, node_dir: Path, reader: ClusterReader
) -> dict[str, Path]:
    """Create each volume's directory and its files; return volume name → host dir."""
    namespace = pod["metadata"]["namespace"]
    result: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes", []):
        name = volume["name"]
        if "hostPath" in volume:
            directory = node_dir / "hostpath" / volume["hostPath"]["path"].strip("/")
        else:
            directory = pod_dir / "volumes" / name
        directory.mkdir(parents=True, exist_ok=True)
        files: dict[str, str] = {}
        if "configMap" in volume:
            files = reader.config_map(namespace, volume["configMap"]["name"])
        elif "secret" in volume:
            files = reader.secret(namespace, volume["secret"]["secretName"])
        elif "downwardAPI" in volume:
            files = {
                i["path"]: field_value(pod, i["fieldRef"]["fieldPath"])
                for i in volume["downwardAPI"]["items"]
            }
        elif "projected" in volume:
            files = _projected_files(volume["projected"], pod, reader)
        elif not ({"emptyDir", "hostPath"} & volume.keys()):
            raise PodSpecError(f"volume {name}: unsupported type {sorted(volume)}")
        for relative, content in files.items():
            target = directory / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        result[name] = directory
    return result


def _projected_files(
    projected: dict[str, Any], pod: dict[str, Any], reader: ClusterReader
) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    files: dict[str, str] = {}
    for source in projected.get("sources", []):
        if "serviceAccountToken" in source:
            account = pod["spec"].get("serviceAccountName", "default")
            files[source["serviceAccountToken"]["path"]] = reader.service_account_token(
                namespace, account, pod
            )
        elif "configMap" in source:
            data = reader.config_map(namespace, source["configMap"]["name"])
            items = source["configMap"].get("items") or [{"key": k, "path": k} for k in data]
            files.update({i["path"]: data[i["key"]] for i in items})
        elif "downwardAPI" in source:
            files.update(
                {
                    i["path"]: field_value(pod, i["fieldRef"]["fieldPath"])
                    for i in source["downwardAPI"]["items"]
                }
            )
        elif "secret" in source:
            data = reader.secret(namespace, source["secret"]["name"])
            files.update(data)
    return files


def launch_spec(
    container: dict[str, Any],
    pod: dict[str, Any],
    volumes: dict[str, Path],
    reader: ClusterReader,
    base_env: dict[str, str],
) -> ContainerLaunch:
    """Everything needed to start `container` of `pod` as a local process."""
    command = container.get("command")
    if not command:
        raise PodSpecError(
            f"container {container['name']} has no command: "
            "the local runner cannot read an image's entrypoint"
        )
    env = container_env(container, pod, reader, base_env)
    argv = [expand(str(part), env) for part in [*command, *container.get("args", [])]]
    mounts = []
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in volumes:
            raise PodSpecError(f"volumeMount {mount['name']} names no volume")
        source = volumes[mount["name"]]
        if mount.get("subPath"):
            source = source / mount["subPath"]
        mounts.append((source, mount["mountPath"]))
    return ContainerLaunch(container["name"], argv, env, mounts, container.get("workingDir"))


def decode_secret(data: dict[str, str] | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (data or {}).items()}
