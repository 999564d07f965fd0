"""The WeightSync resource as a whole, v1alpha1."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import ConfigDict, Field

from weightsync.api.base import ApiModel, Int64
from weightsync.api.group import KIND
from weightsync.api.v1alpha1.spec import WeightSyncSpec
from weightsync.api.v1alpha1.status import WeightSyncStatus

VERSION: Final = "v1alpha1"
API_VERSION: Final = "weightsync.io/v1alpha1"  # GROUP/VERSION, spelled out for the Literal below


class ObjectMeta(ApiModel):
    """The parts of the object's metadata the operator reads."""

    # The API server owns metadata and adds fields (managedFields, finalizers, ...)
    # that are not ours to validate, so unknown keys are dropped, not rejected.
    model_config = ConfigDict(extra="ignore")

    name: str | None = None
    """name is the WeightSync's name."""

    namespace: str | None = None
    """namespace is the WeightSync's namespace."""

    uid: str | None = None
    """uid is the API server's unique id of this object."""

    generation: Int64 | None = None
    """generation counts changes to the spec; conditions record which one they saw."""

    resource_version: str | None = None
    """resourceVersion is the API server's version of this object."""

    labels: dict[str, str] = Field(default_factory=dict)
    """labels are the object's labels."""

    annotations: dict[str, str] = Field(default_factory=dict)
    """annotations are the object's annotations."""


class WeightSync(ApiModel):
    """WeightSync moves weights from a trainer StatefulSet to inference Deployments."""

    api_version: Literal["weightsync.io/v1alpha1"] = API_VERSION
    """apiVersion is weightsync.io/v1alpha1."""

    kind: Literal["WeightSync"] = KIND
    """kind is WeightSync."""

    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    """metadata is the object's metadata."""

    spec: WeightSyncSpec
    """spec is the desired state: which trainer publishes, which Deployments receive, and how."""

    status: WeightSyncStatus = Field(default_factory=WeightSyncStatus)
    """status is the observed state: conditions, the group's members and the last round.
    Only the operator writes it."""
