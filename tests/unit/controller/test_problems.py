"""What stops a pass before it reaches the agents: missing workloads, and source ranks the
trainer never runs (they used to hold the group back forever while it said "healthy")."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.controller.builders import sync
from weightsync.api import reasons
from weightsync.controller.status.problems import unmet


def statefulset(replicas: int | None) -> dict[str, Any]:
    return {
        "metadata": {"name": "trainer"},
        "spec": {} if replicas is None else {"replicas": replicas},
    }


def test_missing_workloads_come_first() -> None:
    spec = sync()
    assert unmet(spec, None, {"engine-a": {}}) == (
        reasons.TRAINER_NOT_FOUND,
        "StatefulSet trainer does not exist in this namespace.",
    )
    problem = unmet(spec, statefulset(1), {"engine-a": None})
    assert problem is not None
    assert problem[0] == reasons.DEPLOYMENT_NOT_FOUND
    assert unmet(spec, statefulset(1), {"engine-a": {}}) is None


@pytest.mark.parametrize(
    ("paths", "replicas", "beyond"),
    [
        ({"spec.trainer.sourceRanks": [0, 1]}, 1, "1"),
        ({"spec.trainer.sourceRanks": [3, 8, 9]}, None, "3, 8, 9"),  # replicas default 1
        ({"spec.trainer.sourceRanks": [7, 8], "spec.trainer.ranksPerPod": 4}, 2, "8"),
        ({"spec.trainer.sourceRanks": [7], "spec.trainer.ranksPerPod": 4}, 2, None),
        ({"spec.trainer.sourceRanks": ["all"]}, 3, None),
    ],
)
def test_source_ranks_the_trainer_never_runs_are_named(
    paths: dict[str, Any], replicas: int | None, beyond: str | None
) -> None:
    problem = unmet(sync(**paths), statefulset(replicas), {"engine-a": {}})
    if beyond is None:
        assert problem is None
        return
    assert problem is not None
    reason, message = problem
    assert reason == reasons.RANKS_BEYOND_TRAINER
    assert message.startswith(f"spec.trainer.sourceRanks lists {beyond}, but StatefulSet trainer")


def test_a_workload_missing_from_a_young_weightsync_is_pending_not_missing() -> None:
    spec = sync()
    reason, message = unmet(spec, None, {"engine-a": {}}, pending_for=10.0) or ("", "")
    assert reason == reasons.WORKLOAD_PENDING
    assert "trainer" in message
    assert "10 s" in message
    pending = unmet(spec, statefulset(1), {"engine-a": None}, pending_for=10.0)
    assert pending is not None
    assert pending[0] == reasons.WORKLOAD_PENDING
    assert "engine-a" in pending[1]
    # Everything there: nothing pending, whatever the age.
    assert unmet(spec, statefulset(1), {"engine-a": {}}, pending_for=10.0) is None
