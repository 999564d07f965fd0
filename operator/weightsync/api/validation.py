"""Reading and checking WeightSyncs in Python: the reconcile-time backstop.

The API server already enforces the CRD schema and its CEL rules; the operator
calls these functions anyway, because an object stored before a CRD upgrade, or
written while validation was off, must still fail loudly and with the same field
paths the API server would have printed (`spec.inference[1].port`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from weightsync.api.cel import LOCATED_ERROR_TYPE, CelRule
from weightsync.api.v1alpha1 import WeightSync
from weightsync.api.v1alpha1.colocated import MODE_IMMUTABLE
from weightsync.api.v1alpha1.workloads import (
    JOB_IMMUTABLE,
    JOBSET_IMMUTABLE,
    TRAINER_IMMUTABLE,
    TRAINER_KIND_IMMUTABLE,
)


def _name(ref: Any) -> str | None:
    return None if ref is None else str(ref.name)


@dataclass(frozen=True)
class ImmutableField:
    """A field guarded by a `self == oldSelf` rule in the CRD."""

    path: str
    rule: CelRule
    value: Callable[[WeightSync], object]


# Every transition rule of the CRD, in Python; a unit test keeps the two lists equal.
IMMUTABLE_FIELDS = (
    ImmutableField("spec.mode", MODE_IMMUTABLE, lambda sync: sync.spec.mode),
    ImmutableField("spec.trainer", TRAINER_KIND_IMMUTABLE, lambda sync: sync.spec.trainer.kind),
    ImmutableField(
        "spec.trainer.statefulSetRef.name",
        TRAINER_IMMUTABLE,
        lambda sync: _name(sync.spec.trainer.stateful_set_ref),
    ),
    ImmutableField(
        "spec.trainer.jobSetRef.name",
        JOBSET_IMMUTABLE,
        lambda sync: _name(sync.spec.trainer.job_set_ref),
    ),
    ImmutableField(
        "spec.trainer.jobRef.name", JOB_IMMUTABLE, lambda sync: _name(sync.spec.trainer.job_ref)
    ),
)


@dataclass(frozen=True)
class FieldError:
    """One problem, at a Kubernetes-style field path."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class WeightSyncInvalidError(ValueError):
    """A WeightSync breaks the API's rules; `errors` says where and why."""

    def __init__(self, errors: Sequence[FieldError]) -> None:
        self.errors = tuple(errors)
        super().__init__("; ".join(str(error) for error in self.errors))


def field_path(location: Iterable[int | str], below: str = "") -> str:
    """`("spec", "inference", 1, "port")` as `spec.inference[1].port`, then `below`."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    if below.startswith(".") and not path:
        below = below[1:]
    return path + below


def field_errors(error: ValidationError) -> list[FieldError]:
    """pydantic's errors with the paths the API server would print."""
    errors: list[FieldError] = []
    for item in error.errors(include_url=False):
        below = ""
        if item["type"] == LOCATED_ERROR_TYPE:
            below = str(item.get("ctx", {}).get("field_path", ""))
        errors.append(FieldError(field_path(item["loc"], below), item["msg"]))
    return errors


def _plain(value: Any) -> Any:
    """kopf hands out read-only Mapping views; pydantic wants dicts and lists."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def parse_weightsync(obj: Mapping[str, Any]) -> WeightSync:
    """A WeightSync from the API server's JSON (defaults applied), fully validated.

    Raises WeightSyncInvalidError naming every offending field.
    """
    try:
        return WeightSync.model_validate(_plain(obj))
    except ValidationError as error:
        raise WeightSyncInvalidError(field_errors(error)) from None


def check_update(old: WeightSync, new: WeightSync) -> None:
    """Raise WeightSyncInvalidError if `new` changes a field that may not change.

    The Python side of the CRD's transition rules (`self == oldSelf`), which the API
    server evaluates only where the field exists in both (a reference that is set in
    one only is the kind rule's to refuse).
    """
    errors: list[FieldError] = []
    for field in IMMUTABLE_FIELDS:
        before, after = field.value(old), field.value(new)
        if before is not None and after is not None and before != after:
            errors.append(FieldError(field.path, field.rule.message))
    if errors:
        raise WeightSyncInvalidError(errors)
