"""Which failure a trainer is told about when several ranks fail one round."""

from __future__ import annotations

from weightsync.agent.failures import FailureNote, Stage, parse_note, parse_ranks, root_cause
from weightsync.api.control import PlanMember
from weightsync.api.v1alpha1 import Role

MEMBERS = [
    PlanMember(rank=r, pod=f"pod-{r}", host="10.0.0.1", role=Role.SOURCE if r == 0 else Role.SINK)
    for r in range(4)
]


def _note(rank: int, reason: str, stage: Stage = Stage.TRANSFER) -> FailureNote:
    role = "source" if rank == 0 else "sink"
    return FailureNote(
        rank=rank, pod=f"pod-{rank}", role=role, stage=stage, reason=reason, message="m"
    )


def test_an_engine_failure_beats_the_timeouts_it_caused() -> None:
    notes = [
        _note(0, "timeout", Stage.TIMEOUT),
        _note(1, "timeout", Stage.TIMEOUT),
        _note(3, "engine_timeout", Stage.ENGINE_LOAD),
        _note(2, "peer_failed"),
    ]
    cause = root_cause(notes, MEMBERS, me=0)
    assert cause is not None
    assert (cause.pod, cause.reason, cause.stage) == ("pod-3", "engine_timeout", Stage.ENGINE_LOAD)


def test_the_one_silent_member_is_blamed_when_every_note_is_secondhand() -> None:
    notes = [_note(0, "collective_error"), _note(1, "collective_error"), _note(3, "peer_failed")]
    cause = root_cause(notes, MEMBERS, me=0)
    assert cause is not None
    assert (cause.pod, cause.reason, cause.stage) == ("pod-2", "member_lost", Stage.TRANSFER)
    assert "collective_error" in cause.message


def test_the_source_own_failure_only_when_no_sink_has_one() -> None:
    mine = _note(0, "layout_mismatch", Stage.PREPARE)
    assert root_cause([mine, _note(2, "engine_refused")], MEMBERS, me=0) == _note(
        2, "engine_refused"
    )
    assert root_cause([mine, _note(2, "peer_failed")], MEMBERS[:3], me=0) == mine


def test_all_timed_out_names_the_lowest_rank_and_no_notes_name_nobody() -> None:
    notes = [_note(r, "timeout", Stage.TIMEOUT) for r in range(4)]
    assert root_cause(notes, MEMBERS, me=0) == notes[0]
    assert root_cause([], MEMBERS, me=0) is None


def test_notes_and_rank_lists_parse_defensively() -> None:
    assert parse_ranks(b"3,1,,x,3,") == [1, 3]
    assert parse_note(b"{not json") is None
    note = _note(1, "engine_timeout")
    assert parse_note(note.model_dump_json().encode()) == note
