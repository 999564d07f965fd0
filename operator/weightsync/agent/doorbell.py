"""Doorbell messages and the keys of a generation's store.

How sinks learn that a round started: a *doorbell key* in the generation's TCPStore.
The source writes `doorbell/<seq>` (the round header: version, layout hash, bucket
count) and sinks block in `store.wait` on that key between rounds. We chose this over
a header broadcast with a long idle wait because an idle collective is held open for
as long as the trainer takes between steps (minutes): it would trip the NCCL watchdog
(every collective has a timeout here), pin an NCCL kernel on the inference GPU and
leave a hung peer undetectable. A store wait costs nothing on the GPU, its timeout is
independent of the collective timeout, and the same key space carries the layout (once
per generation), the generation switch and the per-round failure flag.

A round then runs collectives only: buckets by broadcast, double-buffered by parity,
and at the end an all-reduced error flag (every rank fails together), then the
engines commit and a second vote tells the source that every engine serves it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


def doorbell_key(seq: int) -> str:
    return f"doorbell/{seq}"


def failure_key(seq: int) -> str:
    return f"failed/{seq}"


def checksum_key(seq: int) -> str:
    return f"checksums/{seq}"


def layout_key(layout_hash: str) -> str:
    return f"layout/{layout_hash}"


def report_key(digest: str) -> str:
    """A source rank's report (what it holds of each tensor), once per generation."""
    return f"report/{digest}"


def round_report_key(seq: int, rank: int) -> str:
    """The digest of the report source rank `rank` publishes round `seq` with."""
    return f"round/{seq}/report/{rank}"


class RoundHeader(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["round"] = "round"
    seq: int
    version: int
    lineage: str  # the Publisher's: a trainer restarted from an earlier step starts anew
    layout_hash: str
    bucket_count: int
    checksum: bool = False
    # Several source ranks: the digest of each one's report, by rank (`agent.sharded`),
    # "" for one that did not publish in time (the round is failed); empty when one
    # source sends every tensor whole.
    reports: list[str] = []


class SwitchNotice(BaseModel):
    """Rounds continue in `generation`; sinks not in it go idle."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["switch"] = "switch"
    generation: int


Doorbell = Annotated[RoundHeader | SwitchNotice, Field(discriminator="kind")]
DOORBELL: TypeAdapter[Doorbell] = TypeAdapter(Doorbell)
