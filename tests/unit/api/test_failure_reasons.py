"""Round failure reasons: each member is its snake_case string wherever it is written."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from weightsync.api.reasons import FailureReason


class _Message(BaseModel):
    reason: str


@pytest.mark.parametrize("reason", list(FailureReason))
def test_a_failure_reason_is_written_as_its_snake_case_string(reason: FailureReason) -> None:
    label = reason.name.lower()
    assert reason == label
    assert f"{reason}" == str(reason) == "%s" % reason == label  # noqa: UP031 - log formatting
    assert json.dumps(reason) == json.dumps(label)
    assert _Message(reason=reason).model_dump_json() == _Message(reason=label).model_dump_json()
    assert label in frozenset({reason})
