"""Condition reasons and their messages, one pair per state a WeightSync can be in.

Reasons are CamelCase words that programs match on; messages are for people and
are `str.format` templates whose fields are named in each constant. Keeping the
pairs here means every writer says the same thing for the same state.
"""

from __future__ import annotations

from typing import Final

# Any condition, before the operator has finished its first pass.
RECONCILING: Final = "Reconciling"
RECONCILING_MESSAGE: Final = "The operator has not finished its first pass over this spec."

# Ready=False: the spec itself is wrong (the reconcile-time backstop caught it).
INVALID_SPEC: Final = "InvalidSpec"
INVALID_SPEC_MESSAGE: Final = "The spec is invalid: {errors}"

# Ready=False: a referenced workload does not exist.
TRAINER_NOT_FOUND: Final = "TrainerNotFound"
TRAINER_NOT_FOUND_MESSAGE: Final = "StatefulSet {name} does not exist in this namespace."
DEPLOYMENT_NOT_FOUND: Final = "DeploymentNotFound"
DEPLOYMENT_NOT_FOUND_MESSAGE: Final = "Deployment {name} does not exist in this namespace."

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
ROUND_IN_PROGRESS_MESSAGE: Final = "Moving version {version} to {count} sink ranks."
IDLE: Final = "Idle"
IDLE_MESSAGE: Final = "No round is in progress."

# Degraded.
AS_EXPECTED: Final = "AsExpected"
AS_EXPECTED_MESSAGE: Final = "Every member is healthy."
MEMBER_RECOVERING: Final = "MemberRecovering"
MEMBER_RECOVERING_MESSAGE: Final = "{count} members are pulling version {version}: {pods}."
MEMBER_FAILED: Final = "MemberFailed"
MEMBER_FAILED_MESSAGE: Final = "Pod {pod} (rank {rank}) failed: {error}"
ROUND_FAILED: Final = "RoundFailed"
ROUND_FAILED_MESSAGE: Final = "The round for version {version} failed: {error}"
