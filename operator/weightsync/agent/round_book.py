"""What an agent records about its rounds: the version it committed, the last round's
report, whether one runs. The source's and a sink's loops write it as a round starts
and ends; recovery writes the version it loaded; the status reads it.

It sits below both loops (they are handed one), so a round's walk goes down through
the agent's modules and never back up into the `Agent` that owns them.
"""

from __future__ import annotations

from weightsync.agent.engine_watch import EngineWatch
from weightsync.agent.generations import Generation
from weightsync.agent.holder import Holder
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.rounds import RoundOutcome
from weightsync.api.control import GenerationState, RoundReport


class RoundBook:
    def __init__(self, holder: Holder, metrics: AgentMetrics, watch: EngineWatch | None) -> None:
        self.holder = holder
        self.metrics = metrics
        self.watch = watch
        self.version: int | None = None  # the last version this agent committed
        self.lineage: str | None = None  # of `version`
        self.last_round: RoundReport | None = None
        self.round_in_progress = False

    def committed(self) -> tuple[int | None, str | None]:
        return self.version, self.lineage

    def started(self, generation: Generation) -> None:
        self.round_in_progress = True
        self.holder.pinning.pause()
        if generation.state == GenerationState.WARM:
            generation.state = GenerationState.ACTIVE
        self.metrics.generation.set(generation.number)

    def finished(
        self, outcome: RoundOutcome, committed: bool = False, *, hold_pending: bool = False
    ) -> None:
        """A round's end; `committed`: this agent's engine switched to its version (a
        sink's engine may commit although a later vote failed the round elsewhere);
        `hold_pending`: the holder's copy still runs, committed at the Publisher's fence."""
        self.round_in_progress = False
        self.holder.pinning.resume()
        if outcome.ok and not hold_pending:  # every rank committed: the group's version
            self.holder.commit(outcome.version, outcome.lineage)
        elif not outcome.ok:
            self.holder.abandon()
        if committed or outcome.ok:
            self.version, self.lineage = outcome.version, outcome.lineage
        if committed and self.watch is not None:  # this engine process serves it now
            self.watch.committed(outcome.lineage, outcome.version)
        if outcome.ok:
            self.metrics.round_succeeded(outcome.duration_seconds, outcome.nbytes, outcome.version)
        else:
            self.metrics.round_failed(outcome.duration_seconds, outcome.reason, outcome.stage_label)
        self.last_round = outcome.report()

    def recovered(self, version: int, lineage: str) -> None:
        """A P2P recovery loaded `version` into this agent's engine."""
        self.version, self.lineage = version, lineage
        if self.watch is not None:
            self.watch.committed(lineage, version)
