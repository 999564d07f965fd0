"""Messages of the agent's HTTP control API (operator -> agent). No torch here.

Routes (bearer-token auth on every route):
* `PUT /v1/plan`   body `MembershipPlan` -> 202 `PlanAccepted`; the agent forms and
  pre-warms that generation in the background. 409 `ErrorResponse` for a plan older
  than the newest the agent holds; 400 for an invalid plan.
* `GET /v1/status` -> 200 `AgentStatus`. Fields added after the first release are
  sent only when asked for (`?with=field,...`, `STATUS_ADDITIONS`): an operator that
  does not know a field (its messages forbid unknown ones) never asks for it.
* `GET /v1/holding` -> 200 `Holding` (the committed version this agent holds in host
  memory for P2P pulls), or 404 `ErrorResponse` when it holds none.
* `POST /v1/recover` body `RecoverRequest` -> 202 `RecoveryStatus` (pending); the agent
  pulls the version from the holders in the background and reports in
  `AgentStatus.recovery`. 409 while a round or another recovery runs, or while the agent
  is a member of a warm group generation; 400 for an invalid request.

Durations are integers with their unit in the name, like the WeightSync status.
Every request carries the operator's protocol version, every status the agent's; which
fields each side sends the other, and which versions work together, is
`weightsync.api.protocol`'s skew policy.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from weightsync.api.engines import EngineOptions
from weightsync.api.v1alpha1.colocated import MemoryRelease, SyncMode
from weightsync.api.v1alpha1.dataplane import PrewarmSpec, RecoveryProtocol, TransferSpec
from weightsync.api.v1alpha1.spec import Engine
from weightsync.api.v1alpha1.status import Role


class Backend(StrEnum):
    GLOO = "gloo"
    NCCL = "nccl"


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# The WeightSync's defaults (the CRD's), which a plan's absent fields take.
_SPEC_TRANSFER = TransferSpec()
_SPEC_PREWARM = PrewarmSpec()


class TransferOptions(_Message):
    """A WeightSync's `transfer`, as the agents get it."""

    bucket_size_bytes: int = Field(default=_SPEC_TRANSFER.bucket_size_bytes, gt=0)
    pipeline_depth: int = Field(default=_SPEC_TRANSFER.pipeline_depth, ge=1, le=8)
    timeout_seconds: float = Field(default=float(_SPEC_TRANSFER.timeout_seconds), gt=0)
    checksum: bool = False


DEFAULT_TRANSFER = TransferOptions()


class Rendezvous(_Message):
    """The TCPStore on the rank-0 agent (the trainer's source agent)."""

    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)


class PlanMember(_Message):
    rank: int = Field(ge=0)
    pod: str = Field(min_length=1)
    host: str = Field(min_length=1)  # the member's pod IP; gloo binds to it
    role: Role


class LocalEngine(_Message):
    """The engine a Colocated source hands its buckets to: on the same GPU, another pod.

    The operator picks the inference pod on the trainer's node; when it is replaced, the
    new pod's engine comes in a new generation's plan.
    """

    pod: str = Field(min_length=1)
    engine: Engine
    url: str = Field(min_length=1)  # its HTTP base URL (pod IP and the entry's port)
    options: EngineOptions = EngineOptions()
    # What `Publisher.release()` frees (`spec.colocated.memoryRelease`).
    memory_release: MemoryRelease = MemoryRelease.NONE


class MembershipPlan(_Message):
    """Generation `generation` of the sync group, addressed to the member with `rank`.

    `members` is the whole roster (ranks 0..world_size-1) or, in a *compact* plan, only
    this member's own entry. The operator sends the roster to the source ranks alone:
    they report rounds and name the member a failure is put down to, while a sink needs
    only its rank, the group's size and the rendezvous (the collectives and the store
    take it from there). That keeps a generation's plans O(members) bytes in all: a
    thousand sinks each carrying the roster were 80 MB per generation.
    """

    sync_name: str = Field(min_length=1)
    generation: int = Field(ge=1)
    rank: int = Field(ge=0)
    backend: Backend
    mode: SyncMode = SyncMode.DISAGGREGATED
    rendezvous: Rendezvous
    members: list[PlanMember] = Field(min_length=1)
    # The group's size and its source ranks (0..source_count-1); implied by a roster,
    # required with a compact plan.
    world_size: int = Field(default=0, ge=0)
    source_count: int = Field(default=0, ge=0)
    transfer: TransferOptions = DEFAULT_TRANSFER
    prewarm_timeout_seconds: float = Field(default=float(_SPEC_PREWARM.timeout_seconds), gt=0)
    # This member keeps the latest committed version in host memory for P2P recovery.
    # The trainer's source agent holds by default (`WEIGHTSYNC_HOLDER`); the operator
    # names further holders here.
    holder: bool = False
    local_engine: LocalEngine | None = None  # Colocated only: where the source hands off

    @model_validator(mode="before")
    @classmethod
    def _sizes_from_roster(cls, data: object) -> object:
        """A plan with a roster may leave out the sizes: they are the roster's."""
        if not isinstance(data, dict) or data.get("world_size"):
            return data
        members = data.get("members")
        if not isinstance(members, list) or (len(members) <= 1 and data.get("rank", 0) != 0):
            return data  # a compact plan must say its sizes; the checks below say so
        roles = [str(m.get("role") if isinstance(m, dict) else m.role) for m in members]
        return {
            **data,
            "world_size": len(members),
            "source_count": sum(1 for r in roles if r.lower() == Role.SOURCE.label),
        }

    @model_validator(mode="after")
    def _check_members(self) -> Self:
        if self.has_roster:
            ranks = sorted(m.rank for m in self.members)
            if ranks != list(range(len(ranks))):
                raise ValueError(f"member ranks must be 0..{len(ranks) - 1} once each, got {ranks}")
            sources = sorted(m.rank for m in self.members if m.role == Role.SOURCE)
            if sources != list(range(len(sources))) or not sources:
                raise ValueError(
                    "the source members are ranks 0..n-1 (rank 0, the first, hosts the"
                    f" rendezvous store), got source ranks {sources}"
                )
            if len(sources) != self.source_count:
                raise ValueError(f"source_count {self.source_count} but {len(sources)} sources")
        else:
            own = self.members[0]
            if len(self.members) != 1 or own.rank != self.rank:
                raise ValueError(
                    "members is the whole roster (world_size entries) or this rank's own entry"
                )
            if self.world_size < 1:
                raise ValueError("a compact plan (one member's entry) must give world_size")
            if not 1 <= self.source_count <= self.world_size:
                raise ValueError(f"source_count {self.source_count} is not in 1..world_size")
            if (own.role == Role.SOURCE) != (self.rank < self.source_count):
                raise ValueError(f"rank {self.rank} and source_count disagree on its role")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not a member of the plan")
        if self.mode == SyncMode.COLOCATED and self.source_count != self.world_size:
            raise ValueError("a Colocated plan has only source members (the lead loads the engine)")
        if self.local_engine is not None and self.mode != SyncMode.COLOCATED:
            raise ValueError("only a Colocated plan names a local engine")
        return self

    @property
    def has_roster(self) -> bool:
        """Whether `members` is the whole group (else only this member's own entry)."""
        return len(self.members) == self.world_size

    @property
    def me(self) -> PlanMember:
        return next(m for m in self.members if m.rank == self.rank)


class PlanAccepted(_Message):
    generation: int
    rank: int
    world_size: int


class GenerationState(StrEnum):
    FORMING = "forming"
    WARM = "warm"  # formed and pre-warmed, not yet serving rounds
    ACTIVE = "active"  # the generation rounds run on
    BROKEN = "broken"  # a round or the formation failed; a new plan is needed
    RETIRED = "retired"  # replaced by a newer generation at a round boundary


class GenerationStatus(_Message):
    generation: int
    state: GenerationState
    rank: int
    world_size: int
    prewarm_millis: int | None = None
    error: str | None = None


class EngineStatus(_Message):
    """The local engine as its agent sees it.

    `version` is what the agent vouches the engine serves: the last version it loaded
    into this engine process (`incarnation`), of `lineage`. None when nothing was, or the
    engine restarted since (a restarted engine is behind, whatever it reports itself,
    which is `reported_version`).
    """

    healthy: bool
    version: int | None
    torn: bool = False
    detail: str = ""
    lineage: str | None = None
    incarnation: str | None = None
    reported_version: int | None = None
    # When `version` was loaded (the agent's clock, the node's): a load older than the
    # engine container's start was into a process that is gone.
    loaded_unix: float | None = None


class RoundReport(_Message):
    version: int
    generation: int | None
    ok: bool
    duration_millis: int
    bytes: int
    bandwidth_bytes_per_second: int
    reason: str = ""  # a short label (also the failure metric's label); empty when ok
    message: str = ""
    finished_at_unix_millis: int
    lineage: str = ""  # the Publisher's lineage the version belongs to
    member: str = ""  # failed: the member the failure is put down to
    stage: str = ""  # failed: prepare, transfer, timeout, engine_load or commit


class RecoveryState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class RecoveryStatus(_Message):
    """The agent's latest recovery; `bytes` counts up while it runs."""

    state: RecoveryState
    version: int  # asked for; once holders are chosen, the (newest) version pulled
    lineage: str = ""
    bytes: int = 0
    duration_millis: int = 0
    bandwidth_bytes_per_second: int = 0  # bytes over the whole recovery, engine load included
    reason: str = ""  # a short label (also the failure metric's label); empty unless failed
    message: str = ""
    holders_used: list[str] = Field(default_factory=list)  # control URLs that served bytes
    holders_failed: dict[str, str] = Field(default_factory=dict)  # control URL -> why dropped
    started_at_unix_millis: int = 0


class RecoveryTransport(_Message):
    """The protocol this agent's holdings and pulls use, resolved once at its start from
    the requested one (`WEIGHTSYNC_P2P_PROTOCOL`) and what its container can use."""

    protocol: RecoveryProtocol  # RDMA or TCP, never Auto
    usable: bool  # False: explicit RDMA without a usable device, or no transfer engine
    detail: str = ""  # why this protocol, or why it cannot work


# `AgentStatus` fields an agent sends only when `GET /v1/status?with=` names them (see the
# module doc); an agent older than a field leaves it out, and it reads as its default.
STATUS_ADDITIONS: tuple[str, ...] = ("recovery_transport", "front")


class FrontStatus(_Message):
    """A sink agent's filtering front (`spec.inference[].front`)."""

    port: int
    # Whether the engine answers on the pod's IP too, where the front protects nothing;
    # None until the engine answers anywhere.
    engine_exposed: bool | None = None


class AgentStatus(_Message):
    pod: str
    role: Role
    generation: int | None  # the active generation
    warm: bool  # the active generation, or the newest one, is pre-warmed
    version: int | None  # the last version this agent committed
    lineage: str | None = None  # of `version`: the Publisher that published it
    round_in_progress: bool
    generations: list[GenerationStatus]
    engine: EngineStatus | None
    last_round: RoundReport | None
    recovery: RecoveryStatus | None = None
    holding: int | None = None  # the version held for P2P pulls; None when none
    holding_lineage: str | None = None
    # Colocated: the pod whose engine the newest plan has this agent load. The operator
    # reads its engine choice back from here, so a restart keeps it.
    local_engine: str | None = None
    recovery_transport: RecoveryTransport | None = None  # in `STATUS_ADDITIONS`
    front: FrontStatus | None = None
    # The agent's control-protocol version (`api.protocol`); absent from the agents
    # released before versions, which speak the oldest.
    protocol_version: int = Field(default=1, ge=1)


class Holding(_Message):
    """A holder's committed version as a puller addresses it (`GET /v1/holding`).

    The version is one contiguous host buffer laid out like the rounds' buckets: bucket
    b at the sum of the sizes (`Bucket.nbytes`) of the buckets before it.
    """

    version: int
    lineage: str = ""  # the Publisher lineage of `version`
    layout: str  # `BucketLayout.to_json()`: re-planned and hash-checked by the puller
    layout_hash: str
    segment: str  # the holder's Mooncake segment, `<host>:<rpc port>`
    address: int  # where bucket 0 starts in the holder's registered memory
    nbytes: int
    protocol: RecoveryProtocol
    # `bucket_checksum` (CRC-32) of each bucket's bytes as held in host memory.
    checksums: list[int]


class RecoverRequest(_Message):
    """Pull the newest version at or after `version` of `lineage` from the agents at
    `holders` and load it into the local engine."""

    version: int = Field(ge=0)
    lineage: str = ""  # empty: any lineage (a holder's is checked when given)
    holders: list[str] = Field(min_length=1, max_length=16)  # agent control URLs
    protocol: RecoveryProtocol  # the holders' protocol (their `recovery_transport`)
    timeout_seconds: float = Field(default=600.0, gt=0)

    @field_validator("protocol")
    @classmethod
    def _check_protocol(cls, protocol: RecoveryProtocol) -> RecoveryProtocol:
        if protocol is RecoveryProtocol.AUTO:
            raise ValueError("a pull names the protocol its holders serve: RDMA or TCP")
        return protocol

    @field_validator("holders")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a holder is an agent control URL (http[s]://host:port): {url}")
        if len(set(urls)) != len(urls):
            raise ValueError("holders are named once each")
        return [url.rstrip("/") for url in urls]


class ErrorResponse(_Message):
    error: str
    detail: str = ""
