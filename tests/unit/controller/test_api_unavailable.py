"""An API server that is away (down, restarting, overloaded) is a warning line and a retry,
not a traceback; anything else keeps its traceback."""

from __future__ import annotations

import logging

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from weightsync.controller.cluster.kube import api_unavailable
from weightsync.controller.passes.reconcile import log_pass_failure


@pytest.mark.parametrize(
    ("error", "away"),
    [
        (ApiException(status=429, reason="storage is (re)initializing"), True),
        (ApiException(status=503), True),
        (urllib3.exceptions.MaxRetryError(None, "/apis", reason=None), True),  # type: ignore[arg-type]
        (ConnectionRefusedError(111, "Connection refused"), True),
        (ApiException(status=404), False),
        (ApiException(status=422), False),
        (ValueError("a bug"), False),
    ],
)
def test_what_counts_as_the_api_server_being_away(error: Exception, away: bool) -> None:
    assert api_unavailable(error) is away


def test_a_pass_failure_logs_one_line_when_the_api_is_away_and_a_traceback_otherwise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="weightsync.controller.passes.reconcile")
    log_pass_failure("resync of ns/sync", ApiException(status=503))
    log_pass_failure("resync of ns/sync", ValueError("a bug"))
    away, bug = caplog.records
    assert (away.levelno, away.exc_info) == (logging.WARNING, None)
    assert "unavailable" in away.getMessage()
    assert bug.levelno == logging.ERROR
    assert bug.exc_info is not None
