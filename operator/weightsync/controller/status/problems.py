"""What stops a pass before it reaches the agents: a status that does not parse, claims
by older WeightSyncs, workloads that do not exist, source ranks the trainer never runs.
Pure: (reason, message) or None."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from weightsync.api import parse_weightsync, reasons
from weightsync.api.v1alpha1 import WeightSync, WeightSyncStatus
from weightsync.api.validation import WeightSyncInvalidError
from weightsync.controller.membership.owners import claim_conflicts, trainer_pods

log = logging.getLogger(__name__)

Problem = tuple[str, str]  # (reason, message) for Ready=False


def stored_status(raw: Mapping[str, Any]) -> WeightSyncStatus:
    """The stored status, or an empty one if it does not parse (then it is rewritten whole)."""
    try:
        return WeightSyncStatus.model_validate(raw.get("status") or {})
    except ValidationError:
        log.warning("status of %s does not parse; rebuilding it", raw["metadata"]["name"])
        return WeightSyncStatus()


def _created(raw: Mapping[str, Any]) -> tuple[str, str]:
    meta = raw["metadata"]
    return (str(meta.get("creationTimestamp") or ""), str(meta.get("name") or ""))


def claimed(
    raw: Mapping[str, Any], sync: WeightSync, listing: Sequence[Mapping[str, Any]]
) -> Problem | None:
    """What the CRD cannot check: workloads an older WeightSync of `listing` claims."""
    older = []
    for other in listing:
        if _created(other) >= _created(raw):
            continue
        try:
            older.append(parse_weightsync(other))
        except WeightSyncInvalidError:
            continue  # an invalid WeightSync syncs nothing, so it claims nothing
    conflicts = claim_conflicts(sync, older)
    if conflicts:
        message = reasons.WORKLOAD_CLAIMED_MESSAGE.format(conflicts="; ".join(conflicts))
        return reasons.WORKLOAD_CLAIMED, message
    return None


def unmet(
    sync: WeightSync,
    trainer: Mapping[str, Any] | None,
    engines: Mapping[str, Mapping[str, Any] | None],
    *,
    pending_for: float | None = None,
) -> Problem | None:
    """The first named workload that does not exist, or listed source ranks the trainer
    never runs. `pending_for`: the WeightSync is younger than that many seconds, and a
    workload that does not exist yet is pending, not missing."""
    spec = sync.spec
    if trainer is None:
        reason, kind, name = reasons.TRAINER_NOT_FOUND, str(spec.trainer.kind), spec.trainer.name
        message = reasons.TRAINER_NOT_FOUND_MESSAGE
    else:
        absent = [name for name, engine in engines.items() if engine is None]
        if not absent:
            return ranks_beyond(sync, trainer)
        kinds = {entry.name: entry.kind for entry in spec.inference}
        reason, kind, name = reasons.DEPLOYMENT_NOT_FOUND, str(kinds[absent[0]]), absent[0]
        message = reasons.DEPLOYMENT_NOT_FOUND_MESSAGE
    if pending_for is not None:
        reason, message = reasons.WORKLOAD_PENDING, reasons.WORKLOAD_PENDING_MESSAGE
    return reason, message.format(kind=kind, name=name, grace=pending_for)


def ranks_beyond(sync: WeightSync, workload: Mapping[str, Any]) -> Problem | None:
    """Listed source ranks the trainer never runs (its pods x ranksPerPod): the group
    would wait for them forever while every member it has looks healthy."""
    trainer = sync.spec.trainer
    if trainer.all_ranks:
        return None
    pods = trainer_pods(trainer.kind, workload)
    replicas = 1 if pods is None else pods
    per_pod = trainer.ranks_per_pod or 1
    beyond = [rank for rank in trainer.listed_ranks() if rank >= replicas * per_pod]
    if not beyond:
        return None
    message = reasons.RANKS_BEYOND_TRAINER_MESSAGE.format(
        ranks=", ".join(str(rank) for rank in beyond),
        kind=trainer.kind,
        name=trainer.name,
        last=replicas * per_pod - 1,
        replicas=replicas,
        per_pod=per_pod,
    )
    return reasons.RANKS_BEYOND_TRAINER, message
