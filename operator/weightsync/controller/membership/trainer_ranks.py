"""Trainer ranks on pods: which of a trainer pod's ranks publish, and how each is addressed. Pure.

A trainer pod runs `ranksPerPod` ranks (torchrun's processes, one per GPU); rank
`ordinal x ranksPerPod + local rank`. The pod's one agent sidecar serves each of its
*source* ranks as a member of its own: local rank i on `cuda:i`, its control port the
injected port + i, its metrics port likewise, its Publisher socket `agent-<i>.sock`.
A pod serving one rank is addressed as before (the pod's name, `agent.sock`); a pod
serving several names each member `<pod>[<local rank>]`, as the agent's status and
failure messages do.

The webhook decides what a pod serves when it admits it (`served_ranks`) and records
it in annotations; the reconcile reads them back (`recorded_ranks`), so a pod is
always planned as what its sidecar actually runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.api.v1alpha1 import WeightSync
from weightsync.controller import names

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ServedRanks:
    """What one trainer pod's sidecar serves."""

    per_pod: int  # ranks the pod runs
    local: tuple[int, ...]  # its local ranks that publish, ascending

    @property
    def several(self) -> bool:
        return len(self.local) > 1

    def global_rank(self, ordinal: int, local: int) -> int:
        return ordinal * self.per_pod + local

    def annotations(self) -> dict[str, str]:
        return {
            names.RANKS_PER_POD_ANNOTATION: str(self.per_pod),
            names.AGENT_RANKS_ANNOTATION: ",".join(str(i) for i in self.local),
        }


def served_ranks(sync: WeightSync, ordinal: int) -> ServedRanks:
    """At admission: the ranks of trainer pod `ordinal` that publish (none: no sidecar)."""
    trainer = sync.spec.trainer
    per_pod = trainer.ranks_per_pod or 1
    local = tuple(i for i in range(per_pod) if trainer.publishes(ordinal * per_pod + i))
    return ServedRanks(per_pod, local)


def recorded_ranks(pod: Obj) -> ServedRanks:
    """What the webhook recorded on an injected pod (a pod injected before ranks per pod
    existed serves its one rank, local rank 0)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    per_pod = str(annotations.get(names.RANKS_PER_POD_ANNOTATION) or "1")
    local = str(annotations.get(names.AGENT_RANKS_ANNOTATION) or "0")
    try:
        return ServedRanks(int(per_pod), tuple(int(i) for i in local.split(",")))
    except ValueError:
        return ServedRanks(1, (0,))


def member_name(pod: str, local: int, served: ServedRanks) -> str:
    """How the operator, the plan and the agent name one rank of a pod."""
    return f"{pod}[{local}]" if served.several else pod


def local_device(device: str, local: int) -> str:
    """Local rank `local`'s device, from the pod's base device ("cpu" or "cuda:0")."""
    return f"cuda:{local}" if device.startswith("cuda") else device


def source_ranks(sync: WeightSync, replicas: int | None, per_pod: Sequence[int]) -> list[int]:
    """The trainer ranks that publish, ascending: the listed ones, or with `[all]` every
    rank of `replicas` pods of `per_pod` ranks (the pods' recorded value, else the
    spec's, else 1: until a pod is injected the count may be short, and then the group
    waits for that pod anyway)."""
    trainer = sync.spec.trainer
    if not trainer.all_ranks:
        return trainer.listed_ranks()
    count = max(per_pod, default=trainer.ranks_per_pod or 1)
    return list(range((replicas if replicas is not None else 1) * count))
