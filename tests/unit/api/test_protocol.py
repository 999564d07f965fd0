"""The control protocol's skew policy, as pure functions: which versions work together,
what a sender leaves out for an older peer, what a receiver tolerates from a newer one."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from tests.support.plans import plan_body
from weightsync.api.control import AgentStatus, MembershipPlan, RecoverRequest
from weightsync.api.protocol import (
    ADDED,
    OLDEST,
    PROTOCOL_VERSION,
    for_peer,
    out_of_skew,
    parse_from,
    sender_version,
    within_skew,
)
from weightsync.api.v1alpha1 import Role

N = PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("peer", "works"),
    [(N - 2, False), (N - 1, True), (N, True), (N + 1, True), (N + 2, False)],
)
def test_an_operator_works_with_agents_one_version_either_side(peer: int, works: bool) -> None:
    assert within_skew(peer) is works
    assert out_of_skew({"pod": peer}) == ({} if works else {"pod": peer})


def test_the_agents_of_the_previous_release_are_within_skew() -> None:
    # They report no version (the oldest): an upgrade to this release must not orphan them.
    assert within_skew(OLDEST)
    assert AgentStatus.model_validate(_old_status()).protocol_version == OLDEST


@pytest.mark.parametrize(("header", "version"), [(None, OLDEST), ("3", 3), (" 2 ", 2)])
def test_a_request_says_its_version_or_is_the_oldest(header: str | None, version: int) -> None:
    assert sender_version(header) == version


@pytest.mark.parametrize("header", ["", "two", "0", "-1", "1.5"])
def test_a_version_header_that_is_no_version_is_refused(header: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        sender_version(header)


def test_a_peer_of_this_version_gets_the_whole_message() -> None:
    plan = MembershipPlan.model_validate(plan_body(holder=True))
    sent = for_peer(plan, N)
    assert sent.lost == ()
    assert MembershipPlan.model_validate_json(sent.json()) == plan


def test_an_older_peer_gets_no_field_its_version_lacks_nested_ones_too() -> None:
    # As if `holder`, the transfer's `checksum` and a member's `host` came in version N.
    added = {"MembershipPlan.holder": N, "TransferOptions.checksum": N}
    plan = MembershipPlan.model_validate(plan_body())
    sent = for_peer(plan, N - 1, added=added)
    assert sent.lost == ()  # both at their defaults: the peer assumes those anyway
    assert "holder" not in sent.data
    assert "checksum" not in sent.data["transfer"]
    assert "checksum" in plan.transfer.model_dump()
    assert sent.data["transfer"]["bucket_size_bytes"] == plan.transfer.bucket_size_bytes
    assert for_peer(plan, N, added=added).data == plan.model_dump(mode="json")
    # A field without a default always says something; in a list, it is named once.
    required = for_peer(plan, N - 1, added={"PlanMember.host": N})
    assert [sorted(m) for m in required.data["members"]] == [["pod", "rank", "role"]] * 2
    assert required.lost == ("members.host",)


def test_a_field_an_older_peer_lacks_is_named_when_it_says_something() -> None:
    added = {"MembershipPlan.holder": N, "TransferOptions.checksum": N}
    plan = MembershipPlan.model_validate(plan_body(holder=True, transfer={"checksum": True}))
    assert set(for_peer(plan, N - 1, added=added).lost) == {"holder", "transfer.checksum"}
    request = RecoverRequest(version=3, holders=["http://10.0.0.1:8470"], protocol="TCP")
    later = {"RecoverRequest.timeout_seconds": N}
    assert for_peer(request, N - 1, added=later).lost == ()
    slow = request.model_copy(update={"timeout_seconds": 5.0})
    assert for_peer(slow, N - 1, added=later).lost == ("timeout_seconds",)


def test_the_status_leaves_its_version_out_for_an_operator_of_the_oldest() -> None:
    # An operator of the previous release forbids unknown fields: it would refuse the answer.
    assert ADDED["AgentStatus.protocol_version"] > OLDEST
    status = AgentStatus.model_validate({**_old_status(), "protocol_version": N})
    assert "protocol_version" not in for_peer(status, OLDEST).data
    assert for_peer(status, N).data["protocol_version"] == N
    assert "front" not in for_peer(status, N, exclude=frozenset({"front"})).data


def test_a_newer_sender_s_unknown_fields_are_ignored_by_field() -> None:
    raw = json.dumps(
        plan_body(
            shiny=1,
            transfer={"checksum": True, "compression": "zstd"},
            members=[
                {"rank": 0, "pod": "trainer-0", "host": "a", "role": "source", "zone": "x"},
                {"rank": 1, "pod": "infer-0", "host": "b", "role": "sink", "zone": "y"},
            ],
        )
    )
    plan, ignored = parse_from(MembershipPlan, raw, N + 1)
    assert set(ignored) == {"shiny", "transfer.compression", "members.zone"}
    assert plan.transfer.checksum
    assert [m.role for m in plan.members] == [Role.SOURCE, Role.SINK]


@pytest.mark.parametrize("sender", [OLDEST, N])
def test_an_unknown_field_from_a_sender_not_newer_is_a_typo(sender: int) -> None:
    raw = json.dumps(plan_body(transfer={"chekcsum": True}))
    with pytest.raises(ValidationError, match=r"transfer\.chekcsum"):
        parse_from(MembershipPlan, raw, sender)


def test_a_newer_sender_s_invalid_message_is_still_refused() -> None:
    raw = json.dumps(plan_body(generation=0, shiny=1))
    with pytest.raises(ValidationError, match=r"generation"):
        parse_from(MembershipPlan, raw, N + 1)
    _, ignored = parse_from(MembershipPlan, json.dumps(plan_body()), N + 1)
    assert ignored == ()


def _old_status() -> dict[str, Any]:
    """A status as an agent of the first release sends it: no version."""
    return {
        "pod": "infer-0",
        "role": "sink",
        "generation": None,
        "warm": False,
        "version": None,
        "round_in_progress": False,
        "generations": [],
        "engine": None,
        "last_round": None,
    }


class _Left(BaseModel):
    model_config = ConfigDict(extra="forbid")
    left: int


class _Right(BaseModel):
    model_config = ConfigDict(extra="forbid")
    left: int
    right: int = 0


class _Either(BaseModel):
    model_config = ConfigDict(extra="forbid")
    side: _Left | _Right


def test_an_unknown_field_in_a_union_is_refused_not_guessed_at() -> None:
    # Its error's path names the union member tried, which is no key of the JSON.
    raw = json.dumps({"side": {"left": 1, "new": 2}})
    with pytest.raises(ValidationError, match=r"new"):
        parse_from(_Either, raw, N + 1)
