"""Events on WeightSyncs, posted by the operator in the background.

`kopf.event` works only inside kopf's own handler tasks (it finds its queue in a context
variable they set), and passes also start from the operator's pod watch (`podwatch`). So
the operator posts its Events itself, as kopf would (the same fields, name prefix and
reporting component): one create each, in the background through the operator's one
writer (`apiwriter`), never waited for by a pass;
a failure is logged (an Event is worth a line, not a retry loop).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from weightsync.api.base import format_timestamp
from weightsync.controller.cluster.kube import Kube
from weightsync.controller.runtime.tasks import Tasks
from weightsync.controller.status.observed import EventSpec

log = logging.getLogger(__name__)

COMPONENT = "weightsync-operator"
NAME_PREFIX = "weightsync-"
MAX_MESSAGE = 1024  # the API server refuses longer Event messages
DRAIN_SECONDS = 5.0  # what a stopping operator gives the Events still being posted

# What a pass posts an Event through: an `EventPoster`, or a test's list.
PostEvent = Callable[[Mapping[str, Any], EventSpec], None]


def event_body(obj: Mapping[str, Any], event: EventSpec, now: datetime) -> dict[str, Any]:
    """A core/v1 Event about `obj` (a WeightSync as the API server sent it)."""
    meta = obj["metadata"]
    message = event.message
    if len(message) > MAX_MESSAGE:
        half = (MAX_MESSAGE - 3) // 2
        message = f"{message[:half]}...{message[-half:]}"
    at = format_timestamp(now)  # a metav1.Time
    return {
        "metadata": {"namespace": meta["namespace"], "generateName": NAME_PREFIX},
        "type": event.type,
        "reason": event.reason,
        "message": message,
        "action": event.reason,
        "reportingComponent": COMPONENT,
        "reportingInstance": socket.gethostname(),
        "source": {"component": COMPONENT},  # `kubectl describe`'s "From"
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "firstTimestamp": at,
        "lastTimestamp": at,
        "eventTime": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),  # a MicroTime
    }


class EventPoster:
    """`poster(obj, event)` from the event loop: the Event is created in the background."""

    def __init__(self, kube: Kube, tasks: Tasks | None = None) -> None:
        self._kube = kube
        self._pending = (tasks or Tasks()).child()

    def __call__(self, obj: Mapping[str, Any], event: EventSpec) -> None:
        body = event_body(obj, event, datetime.now(UTC))
        namespace = body["metadata"]["namespace"]
        task = self._pending.spawn(
            f"event {namespace}/{body['involvedObject']['name']}",
            self._kube.create_event(namespace, body),
        )
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.warning("an Event could not be posted: %s", error)

    async def drain(self) -> None:
        """Wait a little for the Events still being posted (the operator is stopping)."""
        await self._pending.wait(DRAIN_SECONDS)
