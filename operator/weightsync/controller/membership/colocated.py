"""What a Colocated plan names besides its members: the engine the lead hands off to. Pure.

Every member of a Colocated group (one source rank, or every rank of one trainer pod)
gets the same `LocalEngine` in its plan; the lead, rank 0, drives it (`agent.colocated`).
"""

from __future__ import annotations

from weightsync.api.control import LocalEngine
from weightsync.api.engines import EngineOptions
from weightsync.api.v1alpha1 import MemoryRelease, WeightSyncSpec
from weightsync.controller.membership.workloads import PodView


def local_engine(spec: WeightSyncSpec, pod: PodView) -> LocalEngine:
    """How a Colocated source reaches `pod`'s engine: its entry's engine, port, options."""
    if pod.ip is None or pod.inference_index is None:
        raise ValueError(f"pod {pod.name} is no addressable inference pod")
    entry = spec.inference[pod.inference_index]
    return LocalEngine(
        pod=pod.name,
        engine=entry.engine.value,
        url=f"http://{pod.ip}:{entry.port}",
        options=EngineOptions.of(entry),
        memory_release=(
            spec.colocated.memory_release if spec.colocated is not None else MemoryRelease.NONE
        ),
    )
