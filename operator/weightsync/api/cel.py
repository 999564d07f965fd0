"""CEL validation rules, declared once for the CRD and for the Python backstop.

A rule lives next to the model it guards. The CRD generator copies it into
`x-kubernetes-validations`; the model's own validator checks the same condition
in Python and fails with the same message, so the API server and the operator's
reconcile-time check agree word for word (the cluster tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic_core import PydanticCustomError

LOCATED_ERROR_TYPE = "weightsync_field"
"""The pydantic error type whose context says where below the validated node it lies."""


def located_error(message: str, field_path: str = "") -> PydanticCustomError:
    """An error at `field_path` (".inference", "[2]") below the node being validated.

    pydantic reports a model or field validator's error at that model or field; the
    context carries the rest of the path, as a CEL rule's `fieldPath` does.
    """
    # The message travels as a context value so braces in it are never read as a template.
    return PydanticCustomError(
        LOCATED_ERROR_TYPE, "{message}", {"message": message, "field_path": field_path}
    )


class RuleReason(StrEnum):
    """How the API server reports a broken rule (Kubernetes `FieldValueErrorReason`)."""

    INVALID = "FieldValueInvalid"
    FORBIDDEN = "FieldValueForbidden"
    REQUIRED = "FieldValueRequired"
    # FieldValueDuplicate is left out on purpose: the API server drops the rule's
    # message for it, and every rule here must say what is wrong.


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry."""

    rule: str
    message: str
    field_path: str = ""
    """Where the API server reports the error, relative to the node the rule is on."""
    reason: RuleReason = RuleReason.INVALID

    def schema(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.reason is not RuleReason.INVALID:
            entry["reason"] = self.reason.value
        return entry

    def violation(self) -> PydanticCustomError:
        """The error a model validator raises when this rule does not hold."""
        return located_error(self.message, self.field_path)


def validations(*rules: CelRule, **extra: Any) -> dict[str, Any]:
    """A `json_schema_extra` holding `rules` (plus any other `x-kubernetes-*` keys)."""
    return {**extra, "x-kubernetes-validations": [rule.schema() for rule in rules]}
