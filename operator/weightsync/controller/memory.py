"""The reconciler's soft per-WeightSync state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from weightsync.controller.recovery import Tracker


@dataclass
class Memory:
    """Soft per-WeightSync state; losing it (a restart) costs at most a slower timeout."""

    planned_at: dict[int, float] = field(default_factory=dict)
    cooldown: dict[str, float] = field(default_factory=dict)  # pod uid -> monotonic deadline
    recoveries: dict[str, Tracker] = field(default_factory=dict)  # by pod uid
    poll_soon: bool = False  # the last pass left a recovery in flight
    poll: asyncio.Task[None] | None = None  # the pending follow-up pass
    token_written_for: str | None = None  # the WeightSync uid whose token Secret was applied
