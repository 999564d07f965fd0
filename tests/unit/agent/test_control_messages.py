"""The membership plan rejects what no agent could form."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tests.support.plans import plan_body
from weightsync.api.control import MembershipPlan, RecoverRequest


def test_valid_plan_defaults() -> None:
    parsed = MembershipPlan.model_validate(plan_body())
    assert parsed.world_size == 2
    assert parsed.me.pod == "infer-a"
    assert parsed.transfer.bucket_size_bytes == 1024 << 20
    assert parsed.transfer.pipeline_depth == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rank": 2}, "not a member"),
        ({"generation": 0}, "greater than or equal to 1"),
        (
            {
                "members": [
                    {"rank": 0, "pod": "a", "host": "h", "role": "source"},
                    {"rank": 2, "pod": "b", "host": "h", "role": "sink"},
                ]
            },
            "0..1 once each",
        ),
        (
            {
                "members": [
                    {"rank": 0, "pod": "a", "host": "h", "role": "sink"},
                    {"rank": 1, "pod": "b", "host": "h", "role": "sink"},
                ]
            },
            r"source members are ranks 0..n-1.*got source ranks \[\]",
        ),
        (
            {
                "members": [
                    {"rank": 0, "pod": "a", "host": "h", "role": "sink"},
                    {"rank": 1, "pod": "b", "host": "h", "role": "source"},
                ]
            },
            r"got source ranks \[1\]",
        ),
        (
            {
                "members": [
                    {"rank": 0, "pod": "a", "host": "h", "role": "source"},
                    {"rank": 1, "pod": "b", "host": "h", "role": "sink"},
                    {"rank": 2, "pod": "c", "host": "h", "role": "source"},
                ]
            },
            r"got source ranks \[0, 2\]",
        ),
        ({"mode": "Colocated"}, "only source members"),
        ({"transfer": {"pipeline_depth": 0}}, "pipeline_depth"),
        ({"backend": "mpi"}, "backend"),
        ({"unknown": 1}, "Extra inputs"),
    ],
)
def test_invalid_plans(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        MembershipPlan.model_validate(plan_body(**overrides))


def test_a_compact_plan_carries_this_member_and_the_group_size() -> None:
    compact = MembershipPlan.model_validate(
        plan_body(
            rank=2,
            members=[{"rank": 2, "pod": "infer-b", "host": "10.0.0.3", "role": "sink"}],
            world_size=3,
            source_count=1,
        )
    )
    assert (compact.me.pod, compact.world_size, compact.source_count) == ("infer-b", 3, 1)
    assert not compact.has_roster
    assert MembershipPlan.model_validate(plan_body()).has_roster


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # no sizes: a lone sink entry is no roster
            {"rank": 2, "members": [{"rank": 2, "pod": "b", "host": "h", "role": "sink"}]},
            "must give world_size",
        ),
        (  # somebody else's entry
            {
                "rank": 2,
                "world_size": 3,
                "source_count": 1,
                "members": [{"rank": 1, "pod": "b", "host": "h", "role": "sink"}],
            },
            "own entry",
        ),
        (  # a sink at a source rank
            {
                "rank": 1,
                "world_size": 3,
                "source_count": 2,
                "members": [{"rank": 1, "pod": "b", "host": "h", "role": "sink"}],
            },
            "disagree",
        ),
    ],
)
def test_invalid_compact_plans(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        MembershipPlan.model_validate(plan_body(**overrides))


def test_a_pull_names_the_protocol_its_holders_serve_never_auto() -> None:
    request = {"version": 1, "holders": ["http://h:1"]}
    with pytest.raises(ValidationError, match=r"RDMA or TCP"):
        RecoverRequest.model_validate({**request, "protocol": "Auto"})
    assert RecoverRequest.model_validate({**request, "protocol": "TCP"}).protocol == "TCP"
