"""What source and sink rounds share: doorbell messages, store keys, outcomes, slots.

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

import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from weightsync.transfer.buffers import BucketSlots
from weightsync.transfer.layout import BucketLayout


def doorbell_key(seq: int) -> str:
    return f"doorbell/{seq}"


def failure_key(seq: int) -> str:
    return f"failed/{seq}"


def checksum_key(seq: int) -> str:
    return f"checksums/{seq}"


def layout_key(layout_hash: str) -> str:
    return f"layout/{layout_hash}"


class RoundHeader(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["round"] = "round"
    seq: int
    version: int
    layout_hash: str
    bucket_count: int
    checksum: bool = False


class SwitchNotice(BaseModel):
    """Rounds continue in `generation`; sinks not in it go idle."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["switch"] = "switch"
    generation: int


Doorbell = Annotated[RoundHeader | SwitchNotice, Field(discriminator="kind")]
DOORBELL: TypeAdapter[Doorbell] = TypeAdapter(Doorbell)


class RoundFailed(Exception):  # noqa: N818 - an outcome carried up, named like the others
    """A round failed on this rank; `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    version: int
    generation: int | None
    ok: bool
    duration_seconds: float
    nbytes: int
    reason: str = ""
    message: str = ""
    finished_at: float = 0.0

    @classmethod
    def failed(
        cls, version: int, generation: int | None, started: float, reason: str, message: str
    ) -> RoundOutcome:
        return cls(
            version=version,
            generation=generation,
            ok=False,
            duration_seconds=time.monotonic() - started,
            nbytes=0,
            reason=reason,
            message=message,
            finished_at=time.time(),
        )


class SlotPool:
    """The agent's bucket slots, reallocated only when a layout needs more capacity."""

    def __init__(self, device: torch.device, shm_dir: str) -> None:
        self.device = device
        self.shm_dir = shm_dir
        self.slots: BucketSlots | None = None
        self.epoch = 0  # bumps on reallocation; consumers re-attach when it changes

    def ensure(self, layout: BucketLayout, depth: int) -> BucketSlots:
        current = self.slots
        if (
            current is not None
            and current.capacity >= layout.capacity_bytes
            and len(current.slots) == depth
        ):
            return current
        if current is not None:
            current.close()
        self.slots = BucketSlots(depth, layout.capacity_bytes, self.device, self.shm_dir)
        self.epoch += 1
        return self.slots

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None
