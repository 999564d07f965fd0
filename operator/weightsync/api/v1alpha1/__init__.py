"""The weightsync.io/v1alpha1 API: the WeightSync resource."""

from weightsync.api.v1alpha1.agent import AgentResources, AgentSpec, EnvVar, VolumeMount
from weightsync.api.v1alpha1.colocated import ColocatedSpec, MemoryRelease, SyncMode
from weightsync.api.v1alpha1.dataplane import (
    PrewarmSpec,
    ReadinessGateSpec,
    RecoveryProtocol,
    RecoverySpec,
    TransferSpec,
)
from weightsync.api.v1alpha1.front import FrontSpec
from weightsync.api.v1alpha1.resource import API_VERSION, VERSION, ObjectMeta, WeightSync
from weightsync.api.v1alpha1.spec import (
    Engine,
    InferenceSpec,
    PauseMode,
    TrainerSpec,
    WeightSyncSpec,
)
from weightsync.api.v1alpha1.status import (
    Member,
    Role,
    RoundFailure,
    RoundSummary,
    WeightSyncStatus,
)
from weightsync.api.v1alpha1.workloads import (
    DeploymentRef,
    EngineKind,
    JobRef,
    JobSetRef,
    LeaderWorkerSetRef,
    StatefulSetRef,
    TrainerKind,
)

__all__ = [
    "API_VERSION",
    "VERSION",
    "AgentResources",
    "AgentSpec",
    "ColocatedSpec",
    "DeploymentRef",
    "Engine",
    "EngineKind",
    "EnvVar",
    "FrontSpec",
    "InferenceSpec",
    "JobRef",
    "JobSetRef",
    "LeaderWorkerSetRef",
    "Member",
    "MemoryRelease",
    "ObjectMeta",
    "PauseMode",
    "PrewarmSpec",
    "ReadinessGateSpec",
    "RecoveryProtocol",
    "RecoverySpec",
    "Role",
    "RoundFailure",
    "RoundSummary",
    "StatefulSetRef",
    "SyncMode",
    "TrainerKind",
    "TrainerSpec",
    "TransferSpec",
    "VolumeMount",
    "WeightSync",
    "WeightSyncSpec",
    "WeightSyncStatus",
]
