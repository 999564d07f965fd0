"""Why a round failed, in words a trainer can act on: who, at which stage, what it said.

Every rank that fails a round writes a note under the round's failure keys before it
votes (a soft failure: its engine refused a bucket) or flags its peers (a hard one: the
transport broke). The source reads the notes after a failed vote and names one cause:
the first member that failed on its own account, or, when every note only reports a
broken transport, the member that wrote none (a pod that died writes nothing, and gloo's
error names whichever peer connection broke first, often a survivor's).

Stages: `prepare` (layout, slots, engine attach), `transfer` (the broadcast), `timeout`
(the round's deadline passed), `engine_load` (begin and bucket loads), `commit` (the
engine's switch to the version, or the final vote).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, ValidationError

from weightsync.api.control import PlanMember
from weightsync.api.reasons import FailureReason


class Stage(StrEnum):
    PREPARE = "prepare"
    TRANSFER = "transfer"
    TIMEOUT = "timeout"
    ENGINE_LOAD = "engine_load"
    COMMIT = "commit"


# Reasons that only say a peer or the transport went away, or that the deadline passed
# while waiting on the others: the cause lies elsewhere when anyone names one.
SECONDHAND = frozenset(
    {
        FailureReason.PEER_FAILED,
        FailureReason.PEER_ERROR,
        FailureReason.COLLECTIVE_ERROR,
        FailureReason.STORE_ERROR,
        FailureReason.COMMIT_FAILED,
        FailureReason.TIMEOUT,
    }
)


class FailureNote(BaseModel):
    """One rank's account of why it failed a round."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    pod: str
    role: str
    stage: Stage
    reason: str
    message: str

    def describe(self) -> str:
        who = f"{self.pod} (rank {self.rank}, {self.role})"
        return f"{who} at {self.stage}: {self.reason}: {self.message}"


def note_key(seq: int, rank: int) -> str:
    return f"failed/{seq}/rank/{rank}"


def ranks_key(seq: int) -> str:
    """Appended to by every failing rank ("3,"), so a reader knows which notes exist."""
    return f"failed/{seq}/ranks"


def parse_ranks(raw: bytes) -> list[int]:
    return sorted({int(r) for r in raw.decode().split(",") if r.strip().isdigit()})


def parse_note(raw: bytes) -> FailureNote | None:
    try:
        return FailureNote.model_validate_json(raw)
    except ValidationError:
        return None


def root_cause(
    notes: Sequence[FailureNote], members: Sequence[PlanMember], me: int
) -> FailureNote | None:
    """The failure to report: a firsthand one, else a member that went silent."""
    firsthand = [n for n in notes if n.reason not in SECONDHAND and n.rank != me]
    firsthand = firsthand or [n for n in notes if n.reason not in SECONDHAND]
    if firsthand:  # a member's own failure; the source's own only when no sink has one
        return min(firsthand, key=lambda n: n.rank)
    noted = {n.rank for n in notes} | {me}
    silent = [m for m in members if m.rank not in noted]
    if len(silent) == 1 and notes:
        lost = silent[0]
        return FailureNote(
            rank=lost.rank,
            pod=lost.pod,
            role=lost.role.label,
            stage=notes[0].stage,
            reason=FailureReason.MEMBER_LOST,
            message=f"no word from it; the others saw: {notes[0].reason}: {notes[0].message}",
        )
    return min(notes, key=lambda n: n.rank) if notes else None
