"""Reasons and messages the controller needs beyond `weightsync.api.reasons`.

Same conventions (CamelCase reason, `str.format` message). They sit here until the
API package adopts them; the webhook, the reconcile and the docs use these names.
"""

from __future__ import annotations

from typing import Final

# Ready=False: another WeightSync already syncs one of the named workloads.
WORKLOAD_CLAIMED: Final = "WorkloadClaimed"

# Ready=False: the agents' control API has exactly one source per group.
SOURCE_RANKS_UNSUPPORTED: Final = "SourceRanksUnsupported"
SOURCE_RANKS_UNSUPPORTED_MESSAGE: Final = (
    "sourceRanks {ranks}: this agent version forms one group per WeightSync with a single"
    " source rank; list one rank."
)

# Degraded=True: selected pods were created without the sidecar.
SIDECAR_MISSING: Final = "SidecarMissing"
SIDECAR_MISSING_MESSAGE: Final = (
    "Pods without the weightsync-agent sidecar: {pods}. Label the pod template"
    " weightsync.io/inject=true; pods created while the webhook was unreachable must be"
    " deleted to be recreated with it."
)

# Syncing=True (the agent reports that a round is open, not which version).
ROUND_OPEN_MESSAGE: Final = "A round is moving a new version to {count} sink ranks."

# The readiness gate condition on inference pods.
SERVES_CURRENT_VERSION: Final = "ServesCurrentVersion"
# Version-free on purpose: the condition is rewritten only when status or reason
# change, so a message naming a version would go stale after the next round.
SERVES_CURRENT_VERSION_MESSAGE: Final = "The engine serves the WeightSync's current version."
BEHIND_CURRENT_VERSION: Final = "BehindCurrentVersion"
BEHIND_CURRENT_VERSION_MESSAGE: Final = (
    "The engine serves {served}; the current version is {version}."
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
ROUND_FAILED: Final = "RoundFailed"
ROUND_FAILED_MESSAGE: Final = (
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
