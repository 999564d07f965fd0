"""The agents' latest answers: what counts as evidence about a generation, who is unknown."""

from __future__ import annotations

from tests.unit.controller.builders import agent
from weightsync.api.reasons import listing
from weightsync.api.v1alpha1 import Role
from weightsync.controller.agents.view import AgentView, silent


def test_each_pod_keeps_its_latest_poll_answer_or_error() -> None:
    view = AgentView()
    view.record({"a": agent("a"), "b": agent("b")}, {}, asked_at=1.0)
    view.record({}, {"a": "TimeoutError"}, asked_at=2.0)
    assert set(view.statuses) == {"b"}
    assert view.errors == {"a": "TimeoutError"}
    assert view.unpolled(["a", "b", "c"]) == ["c"]
    view.retain({"b"})
    assert view.unpolled(["a", "b"]) == ["a"]


def test_only_answers_asked_after_a_delivery_are_evidence_about_it() -> None:
    view = AgentView()
    view.record({"a": agent("a")}, {}, asked_at=1.0)
    view.record({"b": agent("b")}, {}, asked_at=3.0)
    assert set(view.since(2.0)) == {"b"}
    assert set(view.since(None)) == {"a", "b"}  # delivered before this process started


def test_a_silent_agent_is_unknown_for_a_while_a_refusal_is_no_silence() -> None:
    view = AgentView()
    view.record({"a": agent("a")}, {}, asked_at=0.0)
    view.record({}, {"a": "TimeoutError", "b": "HTTP 401 unauthorized"}, asked_at=10.0)
    view.record({}, {"a": "TimeoutError"}, asked_at=20.0)
    assert view.unknown(now=30.0, keep_seconds=60.0) == {"a"}  # silent since 10 s
    assert view.unknown(now=80.0, keep_seconds=60.0) == frozenset()
    view.record({"a": agent("a")}, {}, asked_at=85.0)
    view.record({}, {"a": "TimeoutError"}, asked_at=90.0)
    assert view.unknown(now=100.0, keep_seconds=60.0) == {"a"}  # a new silence
    assert silent("ServerTimeoutError: read")
    assert silent("ServerDisconnectedError")
    assert not silent("HTTP 401 unauthorized")
    assert not silent("unexpected reply to GET http://a/v1/status: 2 errors")


def test_messages_name_a_few_and_count_the_rest() -> None:
    assert listing(["a", "b"]) == "a, b"
    assert listing([f"p{i}" for i in range(1000)]) == "p0, p1, p2, p3, p4 and 995 more"


def test_a_snapshot_keeps_the_answers_it_was_taken_with() -> None:
    view = AgentView()
    view.record({"e-1": agent("e-1", engine_version=1)}, {}, asked_at=1.0)
    seen = view.snapshot()
    view.record({"e-1": agent("e-1", engine_version=2)}, {"e-2": "TimeoutError"}, asked_at=2.0)
    engine = seen.statuses["e-1"].engine
    assert engine is not None
    assert engine.version == 1
    assert seen.heard_at == {"e-1": 1.0}
    assert not seen.errors
    assert not seen.silent_since


def test_when_an_agent_first_said_its_version_is_kept_until_it_says_another() -> None:
    view = AgentView()
    source = agent("trainer-0", Role.SOURCE, version=5)
    view.record({"trainer-0": source}, {}, asked_at=1.0)
    newer = agent("trainer-0", Role.SOURCE, version=6)
    view.record({"trainer-0": newer}, {}, asked_at=2.0)
    view.record({"trainer-0": newer}, {}, asked_at=3.0)  # says it again: still since 2.0
    assert view.first_said("trainer-0", newer) == 2.0
    assert view.snapshot().first_said("trainer-0", newer) == 2.0
    assert view.first_said("trainer-0", source) is None  # not what it says now
    relineaged = agent("trainer-0", Role.SOURCE, version=6, lineage="L2")
    view.record({"trainer-0": relineaged}, {}, asked_at=4.0)
    assert view.first_said("trainer-0", relineaged) == 4.0
    view.retain([])
    assert view.first_said("trainer-0", relineaged) is None


def test_an_answer_asked_before_the_one_recorded_is_older_news() -> None:
    """A sweep asked the trainer before its round and heard back after the source timer
    had asked it again: the older answer (and an older timeout) must not undo the newer."""
    view = AgentView()
    view.record({"t": agent("t", Role.SOURCE, version=2)}, {}, asked_at=5.0)
    view.record({"t": agent("t", Role.SOURCE, version=1), "e": agent("e")}, {}, asked_at=4.0)
    assert view.statuses["t"].version == 2
    assert view.heard_at == {"t": 5.0, "e": 4.0}
    assert view.first_said("t", view.statuses["t"]) == 5.0
    view.record({}, {"t": "TimeoutError"}, asked_at=4.5)
    assert view.statuses["t"].version == 2
    assert not view.errors
    view.record({}, {"t": "TimeoutError"}, asked_at=6.0)  # a newer silence does count
    assert view.errors == {"t": "TimeoutError"}
    assert view.snapshot().heard_at == {"t": 6.0, "e": 4.0}
