"""What a reconcile handler tells kopf: a missing workload is waited for quietly (INFO,
the timer looks again), a spec it cannot act on is a permanent error."""

from __future__ import annotations

import logging

import kopf
import pytest

from weightsync.controller.handlers import _raise_for
from weightsync.controller.passes.reconcile import Outcome, Result


def test_a_missing_workload_is_no_error_and_an_invalid_spec_is_permanent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    _raise_for(Result(Outcome.OK, ""))
    _raise_for(Result(Outcome.WAITING, "StatefulSet trainer does not exist in this namespace."))
    (record,) = [r for r in caplog.records if "does not exist" in r.getMessage()]
    assert record.levelno == logging.INFO
    with pytest.raises(kopf.PermanentError, match="bad spec"):
        _raise_for(Result(Outcome.INVALID, "bad spec"))
