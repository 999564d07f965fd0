"""Polling with named timeouts: tests wait for the world, never sleep blindly."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Timeouts:
    """How long tests wait for each kind of thing, in seconds, named so a failure says which."""

    API = 10.0  # an object the API server or a controller writes
    POD_READY = 45.0  # a pod scheduled, its containers started and probed Ready
    POD_REPLACED = 30.0  # a controller replacing a failed or deleted pod
    WEBHOOK = 15.0  # the API server noticing a webhook came or went
    ROUND = 60.0  # a weight-sync round end to end
    GARBAGE_COLLECTION = 30.0  # the controller-manager deleting an owner's dependents


class EventuallyTimeoutError(AssertionError):
    pass


def eventually(
    fn: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.1,
    message: str = "",
) -> T:
    """Call `fn` until it returns something truthy (returned) or `timeout` passes.

    An exception raised by `fn` counts as "not yet" and is shown if time runs out.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = fn()
            if value:
                return value
            last = value
        except Exception as error:
            last = error
        if time.monotonic() >= deadline:
            raise EventuallyTimeoutError(
                f"{message or fn!r} not true after {timeout:.0f}s; last: {last!r}"
            )
        time.sleep(interval)
