"""Rounds with several source ranks, each sending the shard its trainer rank holds.

Each source rank's Publisher attaches the global shape of every tensor and the block of
it that rank holds (`transfer.shards.RankReport`). A round then starts with an exchange
in the generation's store, before any collective:

    every source rank   report/<digest> (once per generation), round/<seq>/report/<rank>
    rank 0 (the lead)   waits for every source rank's digest, then rings the doorbell
                        with all of them in the round header
    other source ranks  wait for that header: it must carry their own digest and version

Every rank (sinks too) turns the digests into the same `ShardPlan` (computed once per
set of reports) and checks it against the header's layout hash. Buckets then travel as
one broadcast per segment from its owner (`transfer.assembly.SlotRoutes`), and every
rank assembles full buckets in its slots. A source rank that does not publish within
the round's timeout fails the round on every rank, named: the lead writes the failure
note in its name, or, when the lead itself did not publish, the ranks that waited for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from weightsync.agent.doorbell import (
    DOORBELL,
    RoundHeader,
    doorbell_key,
    report_key,
    round_report_key,
)
from weightsync.agent.failures import FailureNote, Stage, note_key, ranks_key
from weightsync.agent.group import Group
from weightsync.agent.rounds import RoundFailed
from weightsync.api.control import MembershipPlan
from weightsync.api.reasons import FailureReason
from weightsync.transfer.assembly import SlotRoutes
from weightsync.transfer.broadcast import TransferError
from weightsync.transfer.handoff import Boxes
from weightsync.transfer.layout import BucketLayout, LayoutError
from weightsync.transfer.shards import Box, RankReport, ShardPlan, plan_shards

# The lead's and followers' polls of the generation's store (a local TCP round trip
# each): a round's start waits for them twice, so they are fine-grained.
_POLL_SECONDS = 0.001

_PLANS_KEPT = 4


def _peer_failed(flag: bytes) -> TransferError:
    return TransferError(FailureReason.PEER_FAILED, f"a peer failed the round: {flag.decode()}")


class ShardPlans:
    """Plans by the digests of the source ranks' reports, each computed once: a plan
    over tens of thousands of tensors takes a while, and every round of a run reuses it."""

    def __init__(self) -> None:
        self._plans: dict[tuple[tuple[str, ...], int], ShardPlan] = {}
        self._routes: SlotRoutes | None = None

    def routes(self, plan: ShardPlan, slots: Sequence[torch.Tensor]) -> SlotRoutes:
        """The plan's routes through these slots, kept from round to round (their views
        are built once)."""
        kept = self._routes
        if kept is None or kept.plan is not plan or kept.slots is not slots:
            kept = self._routes = SlotRoutes(plan, slots)
        return kept

    async def get(
        self,
        group: Group,
        digests: Sequence[str],
        bucket_size_bytes: int,
        layout_hash: str | None = None,
    ) -> ShardPlan:
        """The plan of the reports behind `digests`; with `layout_hash` (the header's),
        checked to be the layout the lead announced."""
        if "" in digests:  # the lead rang without it: the round is failed already
            raise RoundFailed(
                FailureReason.PEER_FAILED,
                f"source rank {digests.index('')} did not publish this round",
            )
        key = (tuple(digests), bucket_size_bytes)
        plan = self._plans.get(key)
        if plan is not None:
            _check_layout(plan, layout_hash)
            return plan
        ctl = group.ctl
        raws = await group.run(lambda: [ctl.get(report_key(d)) for d in digests])
        reports = [RankReport.from_json(raw) for raw in raws]
        for rank, report in enumerate(reports):
            if report.rank != rank:
                raise LayoutError(f"the header's report {rank} is source rank {report.rank}'s")
        try:
            plan = await asyncio.to_thread(plan_shards, reports, bucket_size_bytes)
        except LayoutError as exc:
            raise RoundFailed(FailureReason.BAD_SHARDS, str(exc)) from exc
        _check_layout(plan, layout_hash)
        if len(self._plans) >= _PLANS_KEPT:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan


def _check_layout(plan: ShardPlan, layout_hash: str | None) -> None:
    if layout_hash is not None and plan.layout.layout_hash != layout_hash:
        raise RoundFailed(
            FailureReason.LAYOUT_MISMATCH,
            f"the source ranks' reports plan layout {plan.layout.layout_hash[:12]}, the round"
            f" announced {layout_hash[:12]}",
        )


def report_of(layout: BucketLayout, rank: int, boxes: Boxes | None) -> RankReport:
    """This rank's report from its attach: `boxes` as `Attach.boxes` carries them."""
    if boxes is None:
        return RankReport(rank, tuple((m, Box.whole(m.shape)) for m in layout.tensors))
    return RankReport(
        rank,
        tuple(
            (meta, None if box is None else Box(tuple(box[0]), tuple(box[1])))
            for meta, box in zip(layout.tensors, boxes, strict=True)
        ),
    )


async def offer_report(group: Group, seq: int, report: RankReport, sent: set[str]) -> str:
    """Put this rank's report where the round's ranks read it; its digest."""
    digest = report.digest
    ctl, body = group.ctl, report.to_json()

    def offer() -> None:
        if digest not in sent:
            ctl.set(report_key(digest), body)
        ctl.set(round_report_key(seq, report.rank), digest)

    await group.run(offer)
    sent.add(digest)
    return digest


async def gather_reports(
    group: Group, plan: MembershipPlan, seq: int, deadline: float, failure_key: str
) -> tuple[list[str], FailureNote | None]:
    """The lead: every source rank's digest for round `seq`, by rank, once all offered
    one. At `deadline`, those that did not are "" and the first is blamed: its failure
    note is written in its name (it wrote none) and returned."""
    ctl, sources = group.ctl, plan.source_count
    keys = [round_report_key(seq, rank) for rank in range(sources)]

    def gather() -> list[str]:
        while True:
            if ctl.check(keys):  # one round trip while waiting, not one per rank
                return [ctl.get(k).decode() for k in keys]
            if time.monotonic() > deadline:
                offered = [ctl.check([key]) for key in keys]
                return [
                    ctl.get(k).decode() if ok else "" for k, ok in zip(keys, offered, strict=True)
                ]
            if ctl.check([failure_key]):
                raise _peer_failed(ctl.get(failure_key))
            time.sleep(_POLL_SECONDS)

    digests = await group.run(gather)
    if all(digests):
        return digests, None
    note = await blame_missing(group, plan, seq, digests.index(""), failure_key)
    return digests, note


async def blame_missing(
    group: Group, plan: MembershipPlan, seq: int, rank: int, failure_key: str
) -> FailureNote:
    """Fail round `seq` in the name of source rank `rank`, which did not publish: it
    wrote no note of its own, and the ranks that waited for it only know they timed out."""
    member = next(m for m in plan.members if m.rank == rank)
    note = FailureNote(
        rank=member.rank,
        pod=member.pod,
        role=member.role.label,
        stage=Stage.TIMEOUT,
        reason=FailureReason.SOURCE_MISSING,
        message=(
            f"source rank {member.rank} did not publish within the round's"
            f" {plan.transfer.timeout_seconds:g} s (every source rank calls publish each step)"
        ),
    )
    ctl = group.ctl

    def blame() -> None:
        ctl.set(note_key(seq, member.rank), note.model_dump_json())
        ctl.append(ranks_key(seq), f"{member.rank},")  # type: ignore[attr-defined]
        ctl.set(failure_key, f"rank {member.rank}: {note.reason}")

    await group.run(blame)
    return note


async def follow_header(
    group: Group, plan: MembershipPlan, seq: int, deadline: float, failure_key: str
) -> RoundHeader:
    """A source rank other than the lead: the round's header, once the lead rang. A lead
    that never offered its report by `deadline` did not publish: it is blamed here (a
    lead that did publish rings by its own deadline, a missing rank or not)."""
    ctl, key, lead_key = group.ctl, doorbell_key(seq), round_report_key(seq, 0)

    def wait() -> bytes | None:
        while not ctl.check([key]):
            if ctl.check([failure_key]):
                raise _peer_failed(ctl.get(failure_key))
            if time.monotonic() > deadline:
                if ctl.check([lead_key]):
                    raise TransferError(
                        FailureReason.TIMEOUT, f"source rank 0 did not start round {seq}"
                    )
                return None
            time.sleep(_POLL_SECONDS)
        return ctl.get(key)

    raw = await group.run(wait)
    if raw is None:
        note = await blame_missing(group, plan, seq, 0, failure_key)
        raise RoundFailed(FailureReason.PEER_FAILED, note.describe(), Stage.TIMEOUT)
    bell = DOORBELL.validate_json(raw)
    if not isinstance(bell, RoundHeader):
        raise RoundFailed(FailureReason.ROUND_MISMATCH, f"round {seq} is a generation switch here")
    return bell
