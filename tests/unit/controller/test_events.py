"""The Events the operator posts itself: kopf's shape, and messages the API server takes."""

from __future__ import annotations

from datetime import UTC, datetime

from weightsync.controller.cluster.events import MAX_MESSAGE, event_body
from weightsync.controller.status.observed import EventSpec

SYNC = {
    "apiVersion": "weightsync.io/v1alpha1",
    "kind": "WeightSync",
    "metadata": {"name": "sync", "namespace": "team-a", "uid": "u-1", "resourceVersion": "7"},
    "spec": {},
}
NOW = datetime(2026, 11, 26, 12, 0, 0, 250_000, tzinfo=UTC)


def test_an_event_names_the_weightsync_and_the_operator() -> None:
    body = event_body(SYNC, EventSpec("Normal", "GenerationPlanned", "planned 3"), NOW)
    assert body["metadata"] == {"namespace": "team-a", "generateName": "weightsync-"}
    assert body["involvedObject"] == {
        "apiVersion": "weightsync.io/v1alpha1", "kind": "WeightSync",
        "name": "sync", "namespace": "team-a", "uid": "u-1",
    }  # fmt: skip
    assert (body["type"], body["reason"], body["message"]) == (
        "Normal",
        "GenerationPlanned",
        "planned 3",
    )
    assert body["source"] == {"component": "weightsync-operator"}
    # The API server parses a Time with whole seconds, a MicroTime with six digits.
    assert body["firstTimestamp"] == body["lastTimestamp"] == "2026-11-26T12:00:00Z"
    assert body["eventTime"] == "2026-11-26T12:00:00.250000Z"


def test_a_long_message_is_cut_in_the_middle_to_what_the_api_server_takes() -> None:
    message = "a" * 1000 + "b" * 1000
    body = event_body(SYNC, EventSpec("Warning", "PlanRejected", message), NOW)
    assert len(body["message"]) <= MAX_MESSAGE
    assert body["message"].startswith("aaa")
    assert body["message"].endswith("bbb")
    assert "..." in body["message"]
