"""The sidecar's GPUs: exactly its workload's, by allocation, never by leak. Pure.

A sidecar must not ask for a GPU: that allocates another device than its workload's.
Kubernetes shares one allocation between a pod's containers in one way only: a
ResourceClaim (Dynamic Resource Allocation) that several containers name in
`resources.claims` gives each of them the claim's devices, in the same order. So the
sidecar gets every claim the pod's workload containers name, sees exactly their devices,
and uses `cuda:0` (a trainer pod's local rank i: `cuda:i`, `agent.local_ranks`).

A device plugin's resource (`nvidia.com/gpu`) is allocated to the one container that
asks for it, and no other container can be given it; the agent image sets
`NVIDIA_VISIBLE_DEVICES=void`, so the runtime exposes no GPU to a sidecar that asks for
none (a base image's `all` would expose the node's GPU 0: another engine's). A pod whose
GPUs come only from a device plugin is therefore refused at admission, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.api.v1alpha1.agent import GPU_RESOURCES


class GpusNotShareableError(ValueError):
    """The pod's GPUs cannot reach its sidecar; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class GpuAccess:
    device: str  # WEIGHTSYNC_DEVICE: "cuda:0" or "cpu"
    claims: tuple[Mapping[str, Any], ...]  # the sidecar's resources.claims


def _device_plugin_gpus(container: Mapping[str, Any]) -> str | None:
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        for name in GPU_RESOURCES:  # device plugins' GPUs: one container's alone
            value = str((resources.get(kind) or {}).get(name, "0"))
            if value not in ("", "0"):
                return f"{name}: {value}"
    return None


def _claims(containers: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    seen: dict[tuple[str, str], Mapping[str, Any]] = {}
    for container in containers:
        for claim in (container.get("resources") or {}).get("claims") or []:
            key = (str(claim.get("name")), str(claim.get("request") or ""))
            seen.setdefault(key, dict(claim))
    return tuple(seen.values())


def gpu_access(pod: Mapping[str, Any], extra_claims: Sequence[str] = ()) -> GpuAccess:
    """The sidecar's device and claims for `pod`; `extra_claims`: pod claims its
    WeightSync adds (`spec.agent.claims`, e.g. an RDMA NIC). Raises `GpusNotShareableError`."""
    containers = (pod.get("spec") or {}).get("containers") or []
    claims = _claims(containers)
    if not claims:
        for container in containers:
            asked = _device_plugin_gpus(container)
            if asked is not None:
                raise GpusNotShareableError(
                    f"container {container.get('name')!r} gets its GPUs from a device plugin"
                    f" ({asked}), which allocates them to that container alone: the"
                    " weightsync agent sidecar cannot be given the same GPUs. Request them"
                    " through a ResourceClaim (spec.resourceClaims and the container's"
                    " resources.claims), which the sidecar then shares; see"
                    " docs/real-cluster.md, GPUs"
                )
    named = {str(claim.get("name")) for claim in claims}
    more = tuple({"name": name} for name in extra_claims if name not in named)
    return GpuAccess("cuda:0" if claims else "cpu", claims + more)
