"""The observed state of a WeightSync (`status`), v1alpha1. Only the operator writes it."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from enum import StrEnum
from typing import TypeVar

from pydantic import Field, StrictBool, field_validator

from weightsync.api.base import (
    DNS_SUBDOMAIN_MAX_LENGTH,
    ApiModel,
    Int32,
    Int64,
    Timestamp,
)
from weightsync.api.cel import located_error
from weightsync.api.conditions import Condition

MAX_CONDITIONS = 8
MAX_MEMBERS = 1024

T = TypeVar("T")


class Role(StrEnum):
    """What a rank does in a round; `label` is its spelling in labels, env and metrics."""

    SOURCE = "Source"
    SINK = "Sink"

    @property
    def label(self) -> str:
        return self.value.lower()

    @classmethod
    def _missing_(cls, value: object) -> Role | None:  # the label spelling parses too
        return next((r for r in cls if isinstance(value, str) and r.label == value), None)


class Member(ApiModel):
    """One rank of the current group generation."""

    pod: str = Field(min_length=1, max_length=DNS_SUBDOMAIN_MAX_LENGTH)
    """pod is the name of the pod whose agent holds this rank; for a trainer pod whose
    sidecar serves several ranks, `<pod>[<local rank>]`."""

    role: Role
    """role is Source (a trainer rank that publishes) or Sink (an inference rank)."""

    rank: Int32
    """rank is the member's rank in the group; unique within a generation."""

    node: str | None = Field(default=None, max_length=DNS_SUBDOMAIN_MAX_LENGTH)
    """node is the node the pod runs on, once it is scheduled."""

    version: Int64 | None = None
    """version is the weight version this rank holds (a Source) or serves (a Sink); unset
    before its first version."""

    warm: StrictBool
    """warm is true once this rank finished the warm-up collective of the current
    generation."""


class RoundSummary(ApiModel):
    """The last round that completed."""

    version: Int64
    """version is the weight version the round moved (the trainer's step)."""

    completion_time: Timestamp
    """completionTime is when every sink committed the version."""

    duration_millis: Int64
    """durationMillis is how long the round took, from publish to the last commit, in
    milliseconds."""

    bytes: Int64
    """bytes is how many bytes of weights the round moved from each source."""

    bandwidth_bytes_per_second: Int64
    """bandwidthBytesPerSecond is bytes divided by the round's duration, rounded down."""


class RoundFailure(ApiModel):
    """The last round that failed, and why."""

    version: Int64
    """version is the weight version the round tried to move."""

    time: Timestamp
    """time is when the round ended."""

    member: str = Field(default="", max_length=512)
    """member is the member the failure is put down to: `pod (rank r, role)`."""

    stage: str = Field(default="", max_length=32)
    """stage is where it failed: prepare, transfer, timeout, engine_load or commit."""

    reason: str = Field(default="", max_length=128)
    """reason is a short label (also the agents' round-failure metric label)."""

    message: str = Field(default="", max_length=1024)
    """message is what the member said, cut to 1024 characters."""


def _first_duplicate(items: list[T], key: Callable[[T], Hashable]) -> tuple[int, Hashable] | None:
    seen: set[Hashable] = set()
    for index, item in enumerate(items):
        value = key(item)
        if value in seen:
            return index, value
        seen.add(value)
    return None


class WeightSyncStatus(ApiModel):
    """The observed state of a WeightSync."""

    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=MAX_CONDITIONS,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    """conditions are Ready, Prewarmed, Syncing and Degraded, at most one of each type."""

    observed_generation: Int64 | None = None
    """observedGeneration is the metadata.generation the operator last acted on."""

    current_version: Int64 | None = None
    """currentVersion is the newest weight version every ready sink serves; unset until the
    first round completes."""

    lineage: str | None = Field(default=None, max_length=64)
    """lineage names the trainer Publisher that published currentVersion. A new one
    starts when the trainer restarts (from an earlier step too): engines follow it."""

    group_generation: Int64 | None = None
    """groupGeneration counts the group memberships the operator has planned; it grows each
    time a member joins or leaves."""

    member_count: Int32 | None = None
    """memberCount is the number of ranks in the current group generation (the length of
    members)."""

    # Atomic, not a map keyed by rank: only the operator writes it, always whole, and as
    # a map the API server tracked every member's fields (a second status's worth of
    # managedFields); a 1,001-member status patch took 0.51 s on an idle local API
    # server, 0.21 s atomic.
    members: list[Member] = Field(
        default_factory=list,
        max_length=MAX_MEMBERS,
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    """members lists every rank of the current group generation, in rank order."""

    last_round: RoundSummary | None = None
    """lastRound describes the last round that completed."""

    last_failure: RoundFailure | None = None
    """lastFailure is the last round that failed, with who failed it and why."""

    # The two checks below mirror the list-map keys the API server enforces.
    @field_validator("conditions")
    @classmethod
    def _one_condition_per_type(cls, conditions: list[Condition]) -> list[Condition]:
        duplicate = _first_duplicate(conditions, lambda condition: condition.type)
        if duplicate is not None:
            index, value = duplicate
            raise located_error(f'Duplicate value: {{"type":"{value}"}}', f"[{index}]")
        return conditions

    @field_validator("members")
    @classmethod
    def _one_member_per_rank(cls, members: list[Member]) -> list[Member]:
        duplicate = _first_duplicate(members, lambda member: member.rank)
        if duplicate is not None:
            index, value = duplicate
            raise located_error(f'Duplicate value: {{"rank":{value}}}', f"[{index}]")
        return members
