"""Which holders a recovery pulls from: the newest version at or after the one asked, of
its lineage, over its protocol; layout and checksums must agree."""

from __future__ import annotations

import pytest

from weightsync.agent.recovery import RecoveryFailed, choose_holders
from weightsync.api.control import Holding, RecoverRequest
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.transfer.layout import BucketLayout, TensorMeta, plan_layout

TCP, RDMA = RecoveryProtocol.TCP, RecoveryProtocol.RDMA


def layout_of(*sizes: int) -> BucketLayout:
    return plan_layout([TensorMeta(f"t{i}", (n,), "bfloat16") for i, n in enumerate(sizes)], 2048)


LAYOUT = layout_of(1000, 1000, 1000)


def ask(version: int = 5, lineage: str = "L1", protocol: RecoveryProtocol = TCP) -> RecoverRequest:
    return RecoverRequest(
        version=version, lineage=lineage, holders=["http://h:1"], protocol=protocol
    )


def holding(
    version: int = 5,
    *,
    lineage: str = "L1",
    layout: BucketLayout = LAYOUT,
    protocol: RecoveryProtocol = TCP,
    checksums: list[int] | None = None,
    nbytes: int | None = None,
) -> Holding:
    return Holding(
        version=version,
        lineage=lineage,
        layout=layout.to_json(),
        layout_hash=layout.layout_hash,
        segment="10.0.0.1:15000",
        address=1 << 30,
        nbytes=layout.total_bytes if nbytes is None else nbytes,
        protocol=protocol,
        checksums=list(range(len(layout.buckets))) if checksums is None else checksums,
    )


def test_holders_of_older_versions_other_lineages_or_protocols_are_dropped() -> None:
    agreement = choose_holders(
        ask(),
        ["a", "b", "c", "d", "silent"],
        {
            "a": holding(4),
            "b": holding(protocol=RDMA),
            "c": holding(),
            "d": holding(9, lineage="L0"),
        },
    )
    assert [url for url, _ in agreement.holders] == ["c"]
    assert (agreement.version, agreement.lineage) == (5, "L1")
    assert agreement.layout == LAYOUT
    assert agreement.checksums == [0, 1, 2]
    assert agreement.dropped["a"].startswith("version_mismatch")
    assert agreement.dropped["b"].startswith("protocol_mismatch")
    assert agreement.dropped["d"].startswith("lineage_mismatch")
    assert "silent" not in agreement.dropped, "a holder that did not answer is reported apart"


def test_the_newest_held_version_at_or_after_the_one_asked_for_is_pulled() -> None:
    """The trainer published while the pod recovered: an older pull would leave it behind."""
    agreement = choose_holders(ask(5), ["old", "new"], {"old": holding(5), "new": holding(7)})
    assert [url for url, _ in agreement.holders] == ["new"]
    assert agreement.version == 7
    assert agreement.dropped["old"].startswith("older_version")


def test_the_largest_agreeing_group_wins_and_the_others_are_dropped() -> None:
    other = layout_of(1000, 2000)
    wrong_sums = [9, 9, 9]
    holdings = {
        "odd": holding(layout=other),
        "x": holding(),
        "y": holding(),
        "liar": holding(checksums=wrong_sums),
    }
    agreement = choose_holders(ask(), ["odd", "x", "y", "liar"], holdings)
    assert [url for url, _ in agreement.holders] == ["x", "y"]
    assert agreement.dropped["odd"].startswith("layout_mismatch")
    assert agreement.dropped["liar"].startswith("checksum_mismatch")


def test_a_tie_goes_to_the_holder_named_first() -> None:
    other = layout_of(3000)
    holdings = {"first": holding(layout=other), "second": holding()}
    agreement = choose_holders(ask(), ["first", "second"], holdings)
    assert [url for url, _ in agreement.holders] == ["first"]
    assert agreement.layout == other
    assert agreement.dropped["second"].startswith("layout_mismatch")


def test_inconsistent_holdings_are_dropped() -> None:
    tampered = holding().model_copy(update={"layout_hash": "0" * 64})
    holdings = {
        "short": holding(nbytes=LAYOUT.total_bytes - 1),
        "few_sums": holding(checksums=[1]),
        "tampered": tampered,
        "garbage": holding().model_copy(update={"layout": "{}"}),
    }
    with pytest.raises(RecoveryFailed) as caught:
        choose_holders(ask(), list(holdings), holdings)
    assert caught.value.reason == "no_holder"
    dropped = caught.value.dropped
    assert dropped["short"].startswith("bad_holding")
    assert dropped["few_sums"].startswith("bad_holding")
    assert dropped["tampered"].startswith("bad_layout")
    assert dropped["garbage"].startswith("bad_layout")
