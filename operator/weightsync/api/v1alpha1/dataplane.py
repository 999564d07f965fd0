"""How a WeightSync's rounds run: transfer, pre-warm, recovery and the readiness gate
(`spec.transfer`, `spec.prewarm`, `spec.recovery`, `spec.readinessGate`), v1alpha1."""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from pydantic import ConfigDict, Field, StrictBool, model_validator

from weightsync.api.base import ApiModel
from weightsync.api.cel import CelRule, validations

MIB = 1 << 20
GIB = 1 << 30
MAX_STAGING_BYTES = 16 * GIB


class RecoveryProtocol(StrEnum):
    """The transport of a P2P recovery pull. `Auto` is a request only: each agent resolves
    it to RDMA or TCP at start, and holders and pulls always name the one in use."""

    AUTO = "Auto"
    RDMA = "RDMA"
    TCP = "TCP"


# Both fields are defaulted, so a stored object always has them; the has() guards are
# for the API server's own check of `transfer: {}` (the default), which it runs
# against the rule before any nested defaulting.
STAGING_LIMIT = CelRule(
    rule=(
        "!has(self.bucketSizeBytes) || !has(self.pipelineDepth)"
        f" || self.bucketSizeBytes * self.pipelineDepth <= {MAX_STAGING_BYTES}"
    ),
    message=(
        "bucketSizeBytes * pipelineDepth is the staging memory on every GPU and must not"
        f" exceed 16 GiB ({MAX_STAGING_BYTES} bytes)"
    ),
)


class TransferSpec(ApiModel):
    """How a round moves the weights."""

    bucket_size_bytes: int = Field(default=GIB, strict=True, ge=MIB, le=16 * GIB, multiple_of=MIB)
    """bucketSizeBytes is the size of one broadcast bucket in bytes: tensors are packed
    into buckets of this size and each bucket is one collective. Larger buckets reach
    higher bandwidth; every GPU holds pipelineDepth of them. A multiple of 1 MiB
    (1048576) from 1 MiB to 16 GiB; the default is 1 GiB (1073741824), measured to keep a
    round within 1.25x of NCCL's own broadcast on NVLink where 512 MiB did not."""

    pipeline_depth: int = Field(default=2, strict=True, ge=1, le=4)
    """pipelineDepth is how many buckets are in flight at once on each rank: with 2 (the
    default) an engine loads bucket k while bucket k+1 is broadcast. From 1 to 4."""

    timeout_seconds: int = Field(default=60, strict=True, ge=1, le=3600)
    """timeoutSeconds bounds one round, from the header broadcast to the engines' commit;
    a round that takes longer fails on every rank and the communicator is aborted, the
    failure told within the timeout (its last second, or quarter, is kept for that). From
    1 to 3600; the default is 60."""

    checksum: StrictBool = False
    """checksum makes every sink verify a checksum of each bucket before handing it to the
    engine. It costs one pass over the bytes on every rank; off by default."""

    @model_validator(mode="after")
    def _staging_fits(self) -> Self:
        if self.bucket_size_bytes * self.pipeline_depth > MAX_STAGING_BYTES:
            raise STAGING_LIMIT.violation()
        return self

    # pydantic merges this with ApiModel's config; only the schema extra is added.
    model_config = ConfigDict(json_schema_extra=validations(STAGING_LIMIT))


class PrewarmSpec(ApiModel):
    """Pre-warming of the collective group."""

    enabled: StrictBool = True
    """enabled makes agents create the communicator and run a warm-up collective as soon as
    their pod is ready, so the first round does not pay for connection setup. On by
    default."""

    timeout_seconds: int = Field(default=120, strict=True, ge=1, le=3600)
    """timeoutSeconds bounds forming and warming one group generation; a member that is not
    warm by then is left out of the generation and retried. From 1 to 3600; the default is
    120."""


class RecoverySpec(ApiModel):
    """Recovery of restarted inference pods by P2P pull."""

    enabled: StrictBool = True
    """enabled lets a restarted inference pod pull the current version from a holder's
    pinned host copy instead of waiting for the next round. On by default."""

    protocol: RecoveryProtocol = RecoveryProtocol.AUTO
    """protocol is the transport of the pull. Auto (the default): each agent uses RDMA when
    its container can open an RDMA device and register memory (IPC_LOCK or an unlimited
    memlock limit), else TCP; the RecoveryProtocol condition says which is in use. RDMA:
    RDMA or nothing (an agent that cannot use it reports why in that condition; nothing
    falls back to TCP). TCP: works everywhere, slower."""

    holders: int = Field(default=1, strict=True, ge=1, le=8)
    """holders is how many agents keep a pinned host-memory copy of the current version to
    serve pulls. More holders survive more simultaneous failures and cost one model's size
    of host memory each. From 1 to 8; the default is 1."""


class ReadinessGateSpec(ApiModel):
    """The readiness gate on inference pods."""

    enabled: StrictBool = True
    """enabled holds each inference pod NotReady (out of Service endpoints) until its engine
    serves the current version, so no request meets stale weights. On by default."""
