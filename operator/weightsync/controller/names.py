"""Names the operator owns: labels, annotations, condition types, container and volume names.

Everything the operator writes onto other objects lives under `weightsync.io/`, so a
`kubectl get pod -o yaml` shows at a glance what weightsync added.
"""

from __future__ import annotations

import hashlib
from typing import Final

from weightsync.api import GROUP

FINALIZER: Final = f"{GROUP}/finalizer"

# The label users put on the pod templates of their trainer StatefulSet and inference
# Deployments. The pod webhook's objectSelector matches it, so the API server never
# calls the webhook for any other pod (see `admission`).
INJECT_LABEL: Final = f"{GROUP}/inject"
INJECT_VALUE: Final = "true"

# Labels the webhook adds to injected pods: which WeightSync, which role.
SYNC_LABEL: Final = f"{GROUP}/sync"
ROLE_LABEL: Final = f"{GROUP}/role"

# Annotations recording what the webhook injected (read back by the reconcile).
INJECTED_ANNOTATION: Final = f"{GROUP}/injected"  # "<weightsync name>"
AGENT_PORT_ANNOTATION: Final = f"{GROUP}/agent-port"
AGENT_DEVICE_ANNOTATION: Final = f"{GROUP}/agent-device"
INJECTED_CONTAINERS_ANNOTATION: Final = f"{GROUP}/injected-into"  # workload containers touched
# Trainer pods: the ranks the pod runs, and the local ranks its sidecar serves ("0,1").
RANKS_PER_POD_ANNOTATION: Final = f"{GROUP}/ranks-per-pod"
AGENT_RANKS_ANNOTATION: Final = f"{GROUP}/agent-local-ranks"
# Inference pods: the engine container whose readiness probe its agent answers (engine
# health and weights together: `agent.engine_ready`).
ENGINE_READINESS_ANNOTATION: Final = f"{GROUP}/engine-readiness-by-agent"

# The pod readiness gate on inference pods: True only while the pod serves the
# WeightSync's current version.
WEIGHTS_CURRENT: Final = f"{GROUP}/weights-current"

AGENT_CONTAINER: Final = "weightsync-agent"
AGENT_COMMAND: Final = ("weightsync-agent",)
# The sidecar's port that serves an engine's clients (`spec.inference[].front`).
FRONT_PORT_NAME: Final = "ws-front"
SOCKET_VOLUME: Final = "weightsync-socket"
# Names of the token volume, its mount and its Secret key; not secrets themselves.
TOKEN_VOLUME: Final = "weightsync-token"  # noqa: S105
TOKEN_DIR: Final = "/var/run/secrets/weightsync.io"  # noqa: S105
TOKEN_KEY: Final = "token"  # noqa: S105
# Shared memory (mounted on `agent_env.SHM_DIR`) for the agent's CPU bucket slots (which
# the engine maps by name) and for NCCL: a container's own /dev/shm is 64 MiB, and
# writing past it kills with SIGBUS.
SHM_VOLUME: Final = "weightsync-shm"
NODE_VOLUME: Final = "weightsync-node"
NODE_DIR: Final = "/var/run/weightsync-node"
NODE_HOST_ROOT: Final = "/var/run/weightsync/colocated"

STATEFULSET_POD_INDEX_LABEL: Final = "apps.kubernetes.io/pod-index"
# What the Job controller (batch/v1, completionMode Indexed) and the JobSet controller
# (jobset.x-k8s.io, v0.10) put on the pods they create: trainer ranks come from these.
JOB_COMPLETION_INDEX_LABEL: Final = "batch.kubernetes.io/job-completion-index"
JOBSET_GLOBAL_INDEX_LABEL: Final = "jobset.sigs.k8s.io/job-global-index"

_MAX_NAME = 253


def token_secret_name(weightsync: str) -> str:
    """The per-WeightSync Secret holding the agents' control-API bearer token.

    Derived from the WeightSync's name, so the webhook can reference it before the
    reconcile has created it (the kubelet waits for a missing Secret volume).
    """
    suffix = "-agent-token"
    name = f"{weightsync}{suffix}"
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(weightsync.encode()).hexdigest()[:10]
    return f"{weightsync[: _MAX_NAME - len(suffix) - 11]}-{digest}{suffix}"


_MAX_LABEL_VALUE = 63


def sync_label(weightsync: str) -> str:
    """The `weightsync.io/sync` label value for a WeightSync: its name, or, for a name
    longer than a label value may be, a prefix and a hash of the whole name (the way
    Kubernetes' controllers name their children). Readers compare it with this function's
    value for each WeightSync, never parse it back into a name."""
    if len(weightsync) <= _MAX_LABEL_VALUE:
        return weightsync
    digest = hashlib.sha256(weightsync.encode()).hexdigest()[:10]
    prefix = weightsync[: _MAX_LABEL_VALUE - len(digest) - 1].rstrip("-.")
    return f"{prefix}-{digest}"


def node_host_dir(namespace: str, weightsync: str) -> str:
    """The hostPath directory that Colocated pods of one WeightSync share on a node."""
    return f"{NODE_HOST_ROOT}/{namespace}/{weightsync}"
