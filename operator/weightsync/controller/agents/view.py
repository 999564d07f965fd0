"""The agents' latest answers, polled apart from the reconcile passes.

Polling a thousand agents takes longer than a pass should, and a pass runs after every
pod event. So a *sweep* polls every agent of a WeightSync (the drift timer's job, every
`RESYNC_SECONDS`), and a pass reads the latest answers, polling only the agents it has
never heard from (a new pod joins now, not at the next sweep) and those a follow-up
watches (a recovery in flight). Each pod's entry is its latest poll: an answer, or why
there was none.

Answers are stamped with when their request was sent (`heard_at`), so a decision about
a generation can count only answers given after the generation was delivered
(`since`): an older answer is no evidence either way. A member that did not answer is
*unknown*, not gone: `unknown` names the agents whose polls have only timed out for
less than a while (a poll that timed out says nothing about the group; see
`plan.desired_members`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from weightsync.api.control import AgentStatus

# Polls the agent did answer, though not with a status: an HTTP error (it refuses the
# token, say) or a reply that does not parse (`agents.AgentClient`). Those are evidence.
_ANSWERED = ("HTTP ", "unexpected reply")


def silent(error: str) -> bool:
    """Whether a failed poll got no answer at all (timed out, connection refused or
    reset): no evidence about the agent. An agent that is really gone shows in its pod
    (the sidecar's readiness probe fails, the pod leaves), or its group breaks."""
    return not error.startswith(_ANSWERED)


@dataclass
class AgentView:
    """The latest poll of each agent (by pod name); soft state of the reconciler."""

    statuses: dict[str, AgentStatus] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # When each entry's request was sent (monotonic): an answer's, or an error's.
    heard_at: dict[str, float] = field(default_factory=dict)
    silent_since: dict[str, float] = field(default_factory=dict)  # first of the timeouts in a row
    # (version, lineage) each agent reports, and when it was first asked for with that
    # answer (`readiness.round_vouches`: sinks asked no later than that may predate it).
    version_since: dict[str, tuple[int | None, str | None, float]] = field(default_factory=dict)

    def record(
        self, answers: Mapping[str, AgentStatus], errors: Mapping[str, str], asked_at: float
    ) -> None:
        """One poll's results; `asked_at`: when its requests were sent. A pod's result
        asked before the one recorded is older news: polls overlap (a sweep of a thousand
        agents takes seconds, the trainer's are asked every second meanwhile), and an
        answer the trainer gave before its round must not undo one it gave after."""
        newer = {p for p in (*answers, *errors) if self.heard_at.get(p, asked_at) > asked_at}
        answers = {p: s for p, s in answers.items() if p not in newer}
        errors = {p: e for p, e in errors.items() if p not in newer}
        self.heard_at.update(dict.fromkeys((*answers, *errors), asked_at))
        for pod, status in answers.items():
            self.statuses[pod] = status
            said = (status.version, status.lineage)
            known = self.version_since.get(pod)
            if known is None or known[:2] != said:
                self.version_since[pod] = (*said, asked_at)
            self.errors.pop(pod, None)
            self.silent_since.pop(pod, None)
        for pod, error in errors.items():
            self.errors[pod] = error
            self.statuses.pop(pod, None)
            if silent(error):
                self.silent_since.setdefault(pod, asked_at)
            else:
                self.silent_since.pop(pod, None)

    def snapshot(self) -> AgentView:
        """A copy: a pass decides on one set of answers, whatever a sweep records meanwhile."""
        return AgentView(
            dict(self.statuses),
            dict(self.errors),
            dict(self.heard_at),
            dict(self.silent_since),
            dict(self.version_since),
        )

    def retain(self, pods: Collection[str]) -> None:
        """Forget the pods that are gone."""
        tables = (self.statuses, self.errors, self.heard_at, self.silent_since, self.version_since)
        for table in tables:
            for pod in [p for p in table if p not in pods]:
                del table[pod]

    def unpolled(self, pods: Iterable[str]) -> list[str]:
        """Pods never asked (or forgotten): a pass asks them itself."""
        return [p for p in pods if p not in self.statuses and p not in self.errors]

    def since(self, asked_after: float | None) -> dict[str, AgentStatus]:
        """The answers to requests sent at or after `asked_after` (all when None)."""
        if asked_after is None:
            return dict(self.statuses)
        return {p: s for p, s in self.statuses.items() if self.heard_at.get(p, 0) >= asked_after}

    def first_said(self, pod: str, status: AgentStatus) -> float | None:
        """When `pod` was first asked and answered with `status`'s version and lineage
        (None: its last answer here says otherwise)."""
        known = self.version_since.get(pod)
        said = (status.version, status.lineage)
        return known[2] if known is not None and known[:2] == said else None

    def unknown(self, now: float, keep_seconds: float) -> frozenset[str]:
        """Pods whose polls have only timed out, for less than `keep_seconds`."""
        return frozenset(
            pod for pod, since in self.silent_since.items() if now - since < keep_seconds
        )
