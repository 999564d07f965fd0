"""Condition and Event reasons and their messages, one pair per state or event; and the
snake_case labels the data plane reports: `FailureReason` (why a round failed),
`RecoveryFailureReason` (why a recovery failed or was refused), `EngineErrorReason` (why an
engine adapter call failed) and `ErrorCode` (the control API's and the front's refusals).

Condition and Event reasons are CamelCase words that programs match on; messages are for
people and are `str.format` templates whose fields are named in each constant. Keeping the
pairs here means every writer says the same thing for the same state; a message that
names pods or ranks names a few (`listing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Final


def listing(items: Sequence[str], shown: int = 5) -> str:
    """`items` for a message, bounded: the first `shown`, then how many more there are
    (a condition or Event naming a thousand pods helps nobody and may not fit). The bound
    is this default, not a constant: every upper-case name here is a reason with a message."""
    head = ", ".join(items[:shown])
    more = len(items) - shown
    return f"{head} and {more} more" if more > 0 else head


# Ready=False: the spec itself is wrong (the reconcile-time backstop caught it).
INVALID_SPEC: Final = "InvalidSpec"
INVALID_SPEC_MESSAGE: Final = "The spec is invalid: {errors}"

# Ready=False: a referenced workload does not exist yet, in a WeightSync created moments
# ago (applied together with its workloads, in whatever order): not yet the user's error.
WORKLOAD_PENDING: Final = "WorkloadPending"
WORKLOAD_PENDING_MESSAGE: Final = (
    "{kind} {name} does not exist yet; it is reported missing if it still does not"
    " {grace:g} s after this WeightSync was created."
)
# Ready=False: a referenced workload does not exist.
TRAINER_NOT_FOUND: Final = "TrainerNotFound"
TRAINER_NOT_FOUND_MESSAGE: Final = "{kind} {name} does not exist in this namespace."
# Kept for every inference workload kind (LeaderWorkerSets too): alerts and users match it.
DEPLOYMENT_NOT_FOUND: Final = "DeploymentNotFound"
DEPLOYMENT_NOT_FOUND_MESSAGE: Final = "{kind} {name} does not exist in this namespace."
RANKS_BEYOND_TRAINER: Final = "SourceRanksBeyondTrainer"
RANKS_BEYOND_TRAINER_MESSAGE: Final = (
    "spec.trainer.sourceRanks lists {ranks}, but {kind} {name} runs ranks 0 to {last}"
    " ({replicas} pod(s) x ranksPerPod {per_pod}): a rank that never runs would hold every"
    " round back."
)

# Ready=False: the group is not complete yet.
WAITING_FOR_MEMBERS: Final = "WaitingForMembers"
WAITING_FOR_MEMBERS_MESSAGE: Final = "{joined} of {expected} ranks have joined the group."

# Ready=True before the first round: every member joined, nothing published yet.
AWAITING_FIRST_VERSION: Final = "AwaitingFirstVersion"
AWAITING_FIRST_VERSION_MESSAGE: Final = "All {count} ranks joined; no version is published yet."

# Ready=False: some sinks serve an older version than the current one.
MEMBERS_BEHIND: Final = "MembersBehind"
MEMBERS_BEHIND_MESSAGE: Final = "{behind} of {count} sink ranks do not serve version {version}."

# Ready=True: every sink serves the current version.
ALL_MEMBERS_CURRENT: Final = "AllMembersCurrent"
ALL_MEMBERS_CURRENT_MESSAGE: Final = "All {count} sink ranks serve version {version}."

# Prewarmed.
GROUP_WARM: Final = "GroupWarm"
GROUP_WARM_MESSAGE: Final = "Group generation {generation} is warm on all {count} ranks."
WARMING: Final = "Warming"
WARMING_MESSAGE: Final = "Group generation {generation}: {warm} of {count} ranks are warm."
PREWARM_TIMED_OUT: Final = "PrewarmTimedOut"
PREWARM_TIMED_OUT_MESSAGE: Final = (
    "Group generation {generation} was not warm after {seconds}s; cold ranks: {ranks}."
)
PREWARM_DISABLED: Final = "PrewarmDisabled"
PREWARM_DISABLED_MESSAGE: Final = "spec.prewarm.enabled is false; the first round warms the group."

# Syncing.
ROUND_IN_PROGRESS: Final = "RoundInProgress"
ROUND_IN_PROGRESS_MESSAGE: Final = "A round is moving a new version to {count} sink ranks."
IDLE: Final = "Idle"
IDLE_MESSAGE: Final = "No round is in progress."

# Degraded.
AS_EXPECTED: Final = "AsExpected"
AS_EXPECTED_MESSAGE: Final = "Every member is healthy."
MEMBER_FAILED: Final = "MemberFailed"
MEMBER_FAILED_MESSAGE: Final = "Pod {pod} (rank {rank}) failed: {error}"
ROUND_FAILED: Final = "RoundFailed"
ROUND_FAILED_MESSAGE: Final = "The round for version {version} failed: {error}"

# Ready=False: another WeightSync already syncs one of the named workloads.
WORKLOAD_CLAIMED: Final = "WorkloadClaimed"
WORKLOAD_CLAIMED_MESSAGE: Final = "{conflicts}."  # each: who claims which workload

# Degraded=True: selected pods were created without the sidecar.
SIDECAR_MISSING: Final = "SidecarMissing"
SIDECAR_MISSING_MESSAGE: Final = (
    "Pods without the weightsync-agent sidecar: {pods}. Label the pod template"
    " weightsync.io/inject=true; pods created while the webhook was unreachable must be"
    " deleted to be recreated with it (a Job's or JobSet's pods are not deleted by the"
    " operator, since their Job would count them failed: create the WeightSync first,"
    " then the Job or JobSet)."
)


# The readiness gate condition on inference pods.
SERVES_CURRENT_VERSION: Final = "ServesCurrentVersion"
# Version-free on purpose: the condition is rewritten only when status or reason
# change, so a message naming a version would go stale after the next round.
SERVES_CURRENT_VERSION_MESSAGE: Final = "The engine serves the WeightSync's current version."
BEHIND_CURRENT_VERSION: Final = "BehindCurrentVersion"
BEHIND_CURRENT_VERSION_MESSAGE: Final = (
    "The engine serves {served}; the current version is {version}."
)
NOT_IN_ROUNDS: Final = "NotInRounds"
NOT_IN_ROUNDS_MESSAGE: Final = (
    "The engine serves the current version, but its agent is not yet a warm member of the"
    " group generation the trainer's next round runs in: that round would leave it behind."
)
SOURCE_UNHEARD: Final = "SourceUnheard"
SOURCE_UNHEARD_MESSAGE: Final = (
    "The engine serves the current version, but the trainer's source agent did not answer:"
    " whether its next round reaches this pod is unknown."
)
NO_VERSION_YET: Final = "NoVersionYet"
NO_VERSION_YET_MESSAGE: Final = "No weight version has been synced yet."
AGENT_UNREACHABLE: Final = "AgentUnreachable"
AGENT_UNREACHABLE_MESSAGE: Final = "The weightsync agent did not answer: {error}"
AGENT_REFUSES_OPERATOR: Final = "AgentRefusesOperator"
AGENT_REFUSES_OPERATOR_MESSAGE: Final = (
    "The agents of {pods} refuse the operator's credentials (HTTP 401): their Secret is not"
    " the one this operator derives (another operator key?)."
)
AGENT_PROTOCOL_SKEW: Final = "AgentProtocolSkew"
AGENT_PROTOCOL_SKEW_MESSAGE: Final = (
    "The agents of {pods} speak control protocol version {versions}; this operator speaks"
    " {version} and works with agents {low} to {high}. They are not planned: recreate their"
    " pods to give them the operator's agent image."
)
CONTAINERS_NOT_READY: Final = "ContainersNotReady"
CONTAINERS_NOT_READY_MESSAGE: Final = (
    "A container of the pod is not ready (restarted?): the engine is vouched for again"
    " once they are."
)
ENGINE_TORN: Final = "EngineTorn"
ENGINE_TORN_MESSAGE: Final = "The engine reports a partially loaded version."
WEIGHTSYNC_DELETED: Final = "WeightSyncDeleted"
WEIGHTSYNC_DELETED_MESSAGE: Final = (
    "WeightSync {name} was deleted; the gate no longer holds this pod."
)

# Events that are not condition transitions.
POD_RECREATED: Final = "PodRecreated"
POD_RECREATED_MESSAGE: Final = (
    "Deleted pod {pod}: it was created without the agent sidecar (before this WeightSync,"
    " or before the operator's webhook took effect); its {kind} creates it again with it."
)
GENERATION_PLANNED: Final = "GenerationPlanned"
GENERATION_PLANNED_MESSAGE: Final = "Planned group generation {generation}: {count} ranks ({pods})."
PLAN_REJECTED: Final = "PlanRejected"
PLAN_REJECTED_MESSAGE: Final = "Pod {pod} did not accept generation {generation}: {error}"
ROUND_FAILED_EVENT_MESSAGE: Final = (
    "Version {version} failed at {stage}, put down to {member}: {reason}: {message}"
)
NEW_LINEAGE: Final = "NewLineage"
NEW_LINEAGE_MESSAGE: Final = (
    "The trainer started a new lineage (a new Publisher) at version {version} (was"
    " {previous}): engines follow it, lower numbers included."
)
VERSION_SYNCED: Final = "VersionSynced"
VERSION_SYNCED_MESSAGE: Final = (
    "Version {version} reached every sink in {millis} ms ({bytes} bytes)."
)

# P2P recovery of an inference pod that is behind (Events on the WeightSync).
RECOVERY_STARTED: Final = "RecoveryStarted"
RECOVERY_STARTED_MESSAGE: Final = (
    "Pod {pod} pulls version {version} from {holders} over {protocol}."
)
RECOVERED: Final = "Recovered"
RECOVERED_MESSAGE: Final = (
    "Pod {pod} recovered version {version} in {millis} ms ({bytes} bytes,"
    " {bandwidth} bytes/s) from {holders}."
)
RECOVERY_FAILED: Final = "RecoveryFailed"
RECOVERY_FAILED_MESSAGE: Final = (
    "Pod {pod} failed to recover version {version} after {millis} ms: {reason}: {message}"
    " (holders dropped: {dropped}); retrying in {retry} s."
)
RECOVERY_REFUSED_MESSAGE: Final = (
    "Pod {pod} did not start recovering version {version}: {error}; retrying in {retry} s."
)

# RecoveryProtocol: which P2P protocol recovery pulls use (`controller.pull_protocol`).
USING_RDMA: Final = "UsingRDMA"
USING_RDMA_MESSAGE: Final = (
    "Recovery pulls use RDMA on all {count} agents (spec.recovery.protocol {requested};"
    " {pod}: {detail})."
)
USING_TCP: Final = "UsingTCP"
USING_TCP_MESSAGE: Final = (
    "Recovery pulls use TCP on all {count} agents (spec.recovery.protocol {requested};"
    " {pod}: {detail})."
)
PROTOCOLS_DIFFER: Final = "ProtocolsDiffer"
PROTOCOLS_DIFFER_MESSAGE: Final = (
    "Agents resolved spec.recovery.protocol {requested} differently: RDMA on {rdma}; TCP on"
    " {tcp}. A pod on TCP cannot pull from an RDMA holder: it pulls from TCP holders only,"
    " or waits for the next round. Give every pod RDMA devices and ipcLock, or set"
    " spec.recovery.protocol to TCP."
)
PROTOCOL_UNAVAILABLE: Final = "ProtocolUnavailable"
PROTOCOL_UNAVAILABLE_MESSAGE: Final = (
    "Recovery pulls cannot work on {pods}, which neither hold nor pull ({pod}: {detail})."
)
PROTOCOL_NOT_REPORTED: Final = "ProtocolNotReported"
PROTOCOL_NOT_REPORTED_MESSAGE: Final = "No agent has reported its recovery protocol yet."
RECOVERY_OFF: Final = "RecoveryOff"
RECOVERY_OFF_MESSAGE: Final = "No P2P recovery: {why}."


class FailureReason(StrEnum):
    """Why a round failed, in the snake_case labels the agents report: a round's
    `reason` (the Publisher's `PublishResult`, the agent's `RoundReport`, the WeightSync's
    `lastFailure`) and the `reason` label of `weightsync_round_failures_total`.

    A `StrEnum`, so that each member is its string on the wire. An engine's refusal is
    reported as `engine_` and the engine's own reason (`EngineError.reason`), which the
    engines name, not this enum.
    """

    # Before the bytes move: the plan, the group, the layout, the slots, the engine.
    NO_PLAN = "no_plan"
    NO_GROUP = "no_group"
    NOT_FORMED = "not_formed"
    FORMATION_FAILED = "formation_failed"
    PREWARM_FAILED = "prewarm_failed"
    PREWARM_CORRUPT = "prewarm_corrupt"
    GENERATION_CLOSED = "generation_closed"
    GROUP_BROKEN = "group_broken"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    BAD_LAYOUT = "bad_layout"
    LAYOUT_MISMATCH = "layout_mismatch"
    LAYOUT_HASH_MISMATCH = "layout_hash_mismatch"
    LAYOUT_UNAVAILABLE = "layout_unavailable"
    SLOTS_UNAVAILABLE = "slots_unavailable"
    ENGINE_ATTACH_FAILED = "engine_attach_failed"
    # Colocated: the engine's memory, released while the trainer trains.
    ENGINE_RELEASE_FAILED = "engine_release_failed"
    ENGINE_WAKE_FAILED = "engine_wake_failed"
    ROUND_MISMATCH = "round_mismatch"
    # Sharded rounds: the source ranks' shards.
    BAD_SHARDS = "bad_shards"
    SOURCE_MISSING = "source_missing"
    SOURCES_DISAGREE = "sources_disagree"
    # The Publisher and its socket.
    PROTOCOL = "protocol"
    PUBLISHER_PROTOCOL = "publisher_protocol"
    PUBLISHER_GONE = "publisher_gone"
    PUBLISHER_TIMEOUT = "publisher_timeout"
    PUBLISHER_ABANDONED = "publisher_abandoned"
    FILL_FAILED = "fill_failed"
    # The transfer and the votes.
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    COLLECTIVE_ERROR = "collective_error"
    STORE_ERROR = "store_error"
    REPLICA_FAILED = "replica_failed"
    PEER_FAILED = "peer_failed"
    PEER_ERROR = "peer_error"
    MEMBER_LOST = "member_lost"
    BACKEND_DEVICE_MISMATCH = "backend_device_mismatch"
    CHECKSUM_MISMATCH = "checksum_mismatch"  # a sink's buckets differ from the source's
    STALE_VERSION = "stale_version"  # a version not above the last committed one
    # The engines.
    ENGINE_TIMEOUT = "engine_timeout"
    COMMIT_FAILED = "commit_failed"
    # A bug: an exception the round did not expect.
    INTERNAL_ERROR = "internal_error"


class RecoveryFailureReason(StrEnum):
    """Why a P2P recovery failed or was refused: `RecoveryStatus.reason`, the `error` of a
    409 to `POST /v1/recover`, a `P2PError`'s `reason` and the `reason` label of
    `weightsync_recovery_failures_total`. An engine's refusal is reported as `engine_` and
    `EngineError.reason`, as for rounds.

    The operator reads these as plain strings (an agent of another release may send one
    this enum lacks) and only reports them.
    """

    # Refused before it starts.
    NOT_A_SINK = "not_a_sink"
    PROTOCOL_UNAVAILABLE = "protocol_unavailable"
    BUSY = "busy"
    NOT_BEHIND = "not_behind"
    # Choosing holders and pulling from them.
    NO_HOLDER = "no_holder"
    NO_LIVE_HOLDER = "no_live_holder"
    TIMEOUT = "timeout"
    # The transfer engine (`P2PError`).
    TRANSPORT_UNAVAILABLE = "transport_unavailable"
    INIT_FAILED = "init_failed"
    REGISTER_FAILED = "register_failed"
    READ_FAILED = "read_failed"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    HOLDER_TOO_SMALL = "holder_too_small"
    BAD_DESTINATION = "bad_destination"
    DESTINATION_TOO_SMALL = "destination_too_small"
    # The engine, and the recovery itself.
    ENGINE_TIMEOUT = "engine_timeout"
    REPLICA_FAILED = "replica_failed"  # copying a bucket to another of the engine's devices
    YIELDED = "yielded"  # a round started: it brings the engine the version anyway
    INTERNAL_ERROR = "internal_error"


class EngineErrorReason(StrEnum):
    """Why an engine adapter call failed: the `EngineError.reason`s the adapters raise
    themselves. `EngineError.reason` stays a string: an engine's own refusal (the
    reference engine's, passed through) carries the engine's word."""

    TIMEOUT = "timeout"  # no complete reply within the request's timeout
    UNREACHABLE = "unreachable"  # connection refused, reset or dropped
    REJECTED = "rejected"  # the engine answered 4xx (or a 2xx saying success=false)
    ENGINE_FAILED = "engine_failed"  # the engine answered 5xx
    HTTP_ERROR = "http_error"  # the reference engine answered neither 2xx nor a refusal
    BAD_REPLY = "bad_reply"  # a reply the adapter cannot read
    VERSION_MISMATCH = "version_mismatch"  # the engine serves another version after finish
    BAD_BUCKET = "bad_bucket"  # a TensorSlice that does not fit the slot or the engine
    BAD_SLOT = "bad_slot"  # a slot index that was never attached
    SEQUENCE = "sequence"  # calls out of order (load before begin, finish of another version)
    RESTARTED = "restarted"  # the engine process changed since the update began
    UNSUPPORTED = "unsupported"  # the engine cannot do what was asked (release memory)
    SLEEPING = "sleeping"  # the engine released its memory: it serves nothing until woken


class ErrorCode(StrEnum):
    """`ErrorResponse.error`: why the agent's control API or its front refused a request.
    A refused `POST /v1/recover` answers with its `RecoveryFailureReason` instead."""

    # The control API.
    UNAUTHORIZED = "unauthorized"
    INVALID_PLAN = "invalid_plan"
    PLAN_REJECTED = "plan_rejected"
    INVALID_REQUEST = "invalid_request"
    NOT_HOLDING = "not_holding"
    CHECKSUMS_PENDING = "checksums_pending"
    # The front of a sink's engine.
    METHOD_NOT_FORWARDED = "method_not_forwarded"
    UPGRADE_NOT_FORWARDED = "upgrade_not_forwarded"
    BAD_TARGET = "bad_target"
    PRIVATE_ROUTE = "private_route"
    ENGINE_UNREACHABLE = "engine_unreachable"
