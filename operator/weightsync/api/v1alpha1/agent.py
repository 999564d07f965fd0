"""`spec.agent`: what a WeightSync adds to its injected sidecars, for its fabric.

The operator builds the sidecar; a WeightSync may add what the cluster's network needs
(NCCL's and the RDMA stack's environment, an RDMA device plugin's resource or a DRA
NIC's claim, the pod's `/dev/infiniband` volume, `IPC_LOCK` to register memory) and
nothing that widens the agent's reach past that: no `WEIGHTSYNC_*` variable (the
operator's own), no GPU of its own (the sidecar shares its workload's, see
`controller/gpu_access`), and no capability but `IPC_LOCK`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictBool, field_validator
from pydantic.config import JsonDict

from weightsync.api.base import ApiModel
from weightsync.api.cel import CelRule, validations

MAX_ITEMS = 32
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
RESERVED_ENV_PREFIX = "WEIGHTSYNC_"
# Kubernetes' quantity form (resource.Quantity), anchored.
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


def list_of(kind: str, *keys: str) -> JsonDict:
    """A list's schema extras: its list type (and map keys), defaulted to [] as the model is."""
    extra: JsonDict = {"default": [], "x-kubernetes-list-type": kind}
    if keys:
        extra["x-kubernetes-list-map-keys"] = list(keys)
    return extra


ENV_NOT_RESERVED = CelRule(
    rule=f"!self.startsWith('{RESERVED_ENV_PREFIX}')",
    message=f"names starting with {RESERVED_ENV_PREFIX} are the operator's settings of the agent",
)
NO_GPU_OF_ITS_OWN = CelRule(
    rule="self.all(k, !(k in " + str(list(GPU_RESOURCES)).replace('"', "'") + "))",
    message="the sidecar asks for no GPU of its own (that would be another GPU than its"
    " workload's): it shares the workload's ResourceClaims",
)


Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]


class EnvVar(ApiModel):
    """An environment variable of the sidecar (a literal value)."""

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=ENV_NAME_PATTERN,
        json_schema_extra=validations(ENV_NOT_RESERVED),
    )
    """name of the variable, e.g. NCCL_IB_HCA; not one starting with WEIGHTSYNC_."""

    value: str = Field(default="", max_length=4096)
    """value of the variable."""

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name.startswith(RESERVED_ENV_PREFIX):
            raise ENV_NOT_RESERVED.violation()
        return name


class VolumeMount(ApiModel):
    """A volume of the pod mounted into the sidecar (the pod template must declare it)."""

    name: str = Field(min_length=1, max_length=63)
    """name of a volume in the pod's spec.volumes."""

    mount_path: str = Field(min_length=1, max_length=1024, pattern=r"^/")
    """mountPath is where the sidecar sees it (absolute)."""

    read_only: StrictBool = False
    """readOnly mounts it read-only."""


def _no_gpu(resources: dict[str, str]) -> dict[str, str]:
    if any(name in GPU_RESOURCES for name in resources):
        raise NO_GPU_OF_ITS_OWN.violation()
    return resources


class AgentResources(ApiModel):
    """Resource requests and limits merged over the sidecar's."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=MAX_ITEMS,
        json_schema_extra=validations(NO_GPU_OF_ITS_OWN, default={}),
    )
    """requests are added to the sidecar's requests, by resource name."""

    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=MAX_ITEMS,
        json_schema_extra=validations(NO_GPU_OF_ITS_OWN, default={}),
    )
    """limits are added to the sidecar's limits, by resource name."""

    @field_validator("requests", "limits")
    @classmethod
    def _no_gpu_of_its_own(cls, resources: dict[str, str]) -> dict[str, str]:
        return _no_gpu(resources)


class AgentSpec(ApiModel):
    """Additions to the injected agent sidecar: what the cluster's fabric needs."""

    env: list[EnvVar] = Field(
        default_factory=list, max_length=MAX_ITEMS, json_schema_extra=list_of("map", "name")
    )
    """env adds variables to the sidecar, after the chart's (`agent.env`), e.g. NCCL_IB_HCA,
    NCCL_SOCKET_IFNAME, FI_PROVIDER; a name given twice takes the last value."""

    resources: AgentResources = Field(
        default_factory=AgentResources, json_schema_extra={"default": {}}
    )
    """resources are merged over the sidecar's (the chart's `agent.resources`): e.g. an RDMA
    device plugin's resource, more memory for a holder's host copy. No GPU resource."""

    claims: list[Annotated[str, Field(min_length=1, max_length=63)]] = Field(
        default_factory=list, max_length=MAX_ITEMS, json_schema_extra=list_of("set")
    )
    """claims names more of the pod's spec.resourceClaims for the sidecar (e.g. a DRA RDMA
    NIC); the claims of its workload containers it gets without asking."""

    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=MAX_ITEMS, json_schema_extra=list_of("map", "mountPath")
    )
    """volumeMounts mounts volumes the pod declares into the sidecar (e.g. /dev/infiniband)."""

    ipc_lock: StrictBool = False
    """ipcLock adds the IPC_LOCK capability to the sidecar, which RDMA's memory registration
    needs (verbs, EFA); the only capability it can be given. A pod whose sidecar has it no
    longer meets Pod Security "restricted"."""
