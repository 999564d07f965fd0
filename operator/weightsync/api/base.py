"""Shared building blocks of the weightsync API types.

Every API model derives from `ApiModel`: Python attributes in snake_case, JSON in
camelCase, unknown fields rejected, and each field described by the docstring
under it (that docstring becomes the CRD description, so it starts with the JSON
name, as Kubernetes API docs do).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, PlainSerializer, Strict
from pydantic.alias_generators import to_camel

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# DNS-1123 subdomain, the rule Kubernetes applies to Deployment and StatefulSet names.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_SUBDOMAIN_MAX_LENGTH = 253


class ApiModel(BaseModel):
    """Base of every weightsync API type."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        use_attribute_docstrings=True,
        frozen=True,
    )

    def to_k8s(self) -> dict[str, Any]:
        """This object as the API server expects it: camelCase JSON, unset fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def format_timestamp(value: datetime) -> str:
    """RFC 3339 in UTC with whole seconds, the form of a Kubernetes `metav1.Time`."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_now() -> datetime:
    """The current time truncated to seconds, as Kubernetes stores timestamps."""
    return datetime.now(UTC).replace(microsecond=0)


Timestamp = Annotated[AwareDatetime, PlainSerializer(format_timestamp, when_used="json")]
"""A timezone-aware instant, written as `2006-01-02T15:04:05Z`."""

# Integers and booleans are strict: the API server rejects "8000" for an integer
# and "yes" for a boolean, so the Python backstop must not quietly convert them.
Int32 = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
"""A non-negative integer that fits the CRD's int32 format."""

Int64 = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
"""A non-negative integer that fits the CRD's int64 format."""

ObjectName = Annotated[
    str,
    Field(min_length=1, max_length=DNS_SUBDOMAIN_MAX_LENGTH, pattern=DNS_SUBDOMAIN_PATTERN),
]
"""The name of a Kubernetes object in the WeightSync's namespace."""
