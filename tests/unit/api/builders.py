"""A fluent builder of WeightSync manifests (plain dicts, as kubectl would send them)."""

from __future__ import annotations

import copy
from typing import Any, Self

import yaml

API_VERSION = "weightsync.io/v1alpha1"


class WeightSyncBuilder:
    """Starts from the smallest valid WeightSync; every call changes one thing."""

    def __init__(self, name: str = "sync") -> None:
        self._manifest: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": "WeightSync",
            "metadata": {"name": name},
            "spec": {
                "trainer": {"statefulSetRef": {"name": "trainer"}},
                "inference": [
                    {"deploymentRef": {"name": "engine-a"}, "engine": "Reference", "port": 8000}
                ],
            },
        }

    def namespace(self, namespace: str) -> Self:
        self._manifest["metadata"]["namespace"] = namespace
        return self

    def inference(
        self, name: str, engine: str = "Reference", port: int = 8000, **extra: Any
    ) -> Self:
        """Append an inference entry."""
        entry = {"deploymentRef": {"name": name}, "engine": engine, "port": port, **extra}
        self._manifest["spec"]["inference"].append(entry)
        return self

    def set(self, path: str, value: Any) -> Self:
        """Set a dotted path ("spec.transfer.pipelineDepth", "spec.inference.0.port")."""
        *parents, leaf = path.split(".")
        node = self._walk(parents, create=True)
        if isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
        return self

    def delete(self, path: str) -> Self:
        """Remove a dotted path."""
        *parents, leaf = path.split(".")
        node = self._walk(parents, create=False)
        if isinstance(node, list):
            del node[int(leaf)]
        else:
            del node[leaf]
        return self

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self._manifest)

    def yaml(self) -> str:
        return yaml.safe_dump(self.build(), sort_keys=False)

    def _walk(self, parts: list[str], *, create: bool) -> Any:
        node: Any = self._manifest
        for part in parts:
            if isinstance(node, list):
                node = node[int(part)]
            elif create:
                node = node.setdefault(part, {})
            else:
                node = node[part]
        return node


def weightsync(name: str = "sync") -> WeightSyncBuilder:
    return WeightSyncBuilder(name)
