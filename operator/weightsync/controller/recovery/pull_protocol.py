"""Which P2P protocol each agent's recovery pulls use, over which holders, and the
RecoveryProtocol condition that says so. Pure.

Each agent resolves `spec.recovery.protocol` itself at start (`Auto`: RDMA where its
container can open an RDMA device and register memory, else TCP) and reports the result
(`AgentStatus.recovery_transport`). A holder serves one protocol. TCP needs nothing but
the transfer engine, so a puller on RDMA can read TCP holders as well; a puller on TCP
cannot read an RDMA holder. So a pull uses RDMA when the puller and some holders are on
RDMA, else TCP from the holders on TCP, and a pod with no holder it can read waits for
the next round, as when nobody holds. Members on different protocols (some pods given
RDMA devices, some not) are legal but a misconfiguration: the condition is False and
says which pods are on which.

An agent older than the report is taken to use what its environment says: the spec's
protocol when explicit, and TCP under Auto (the webhook writes no protocol for Auto, and
such an agent's default is TCP).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightsync.api import reasons
from weightsync.api.conditions import ConditionStatus, ConditionType, ConditionUpdate
from weightsync.api.control import AgentStatus, RecoveryTransport
from weightsync.api.v1alpha1 import RecoveryProtocol, SyncMode, WeightSyncSpec

RDMA, TCP = RecoveryProtocol.RDMA, RecoveryProtocol.TCP


def member_transport(status: AgentStatus, requested: RecoveryProtocol) -> RecoveryTransport:
    """What `status`'s agent uses; assumed for an agent that does not report it."""
    if status.recovery_transport is not None:
        return status.recovery_transport
    assumed = TCP if requested is RecoveryProtocol.AUTO else requested
    return RecoveryTransport(
        protocol=assumed, usable=True, detail="assumed: the agent does not report its protocol"
    )


def pull_over(
    puller: RecoveryTransport,
    holders: Sequence[str],
    served: Mapping[str, RecoveryTransport],
) -> tuple[RecoveryProtocol, tuple[str, ...]] | None:
    """The protocol of a pull and the holders (of `holders`, kept in order) it can read,
    or None when it can read none. `served`: each holder's transport by URL."""
    if not puller.usable:
        return None
    usable = [
        (url, served[url].protocol) for url in holders if url in served and served[url].usable
    ]
    rdma = tuple(url for url, protocol in usable if protocol is RDMA)
    if puller.protocol is RDMA and rdma:
        return RDMA, rdma
    tcp = tuple(url for url, protocol in usable if protocol is TCP)
    return (TCP, tcp) if tcp else None


def protocol_condition(
    spec: WeightSyncSpec, statuses: Mapping[str, AgentStatus]
) -> ConditionUpdate:
    """The RecoveryProtocol condition from the agents that answered (`statuses`: by pod,
    the live members' only)."""
    kind, requested = ConditionType.RECOVERY_PROTOCOL, spec.recovery.protocol
    false = ConditionStatus.FALSE
    off = (
        "spec.recovery.enabled is false"
        if not spec.recovery.enabled
        else "Colocated groups pull nothing (the trainer's agent reloads its engine)"
        if spec.mode is SyncMode.COLOCATED
        else None
    )
    if off is not None:
        message = reasons.RECOVERY_OFF_MESSAGE.format(why=off)
        return ConditionUpdate(kind, false, reasons.RECOVERY_OFF, message)
    if not statuses:
        return ConditionUpdate(
            kind,
            ConditionStatus.UNKNOWN,
            reasons.PROTOCOL_NOT_REPORTED,
            reasons.PROTOCOL_NOT_REPORTED_MESSAGE,
        )
    used = {pod: member_transport(statuses[pod], requested) for pod in sorted(statuses)}
    broken = [pod for pod, transport in used.items() if not transport.usable]
    if broken:
        message = reasons.PROTOCOL_UNAVAILABLE_MESSAGE.format(
            pods=reasons.listing(broken), pod=broken[0], detail=used[broken[0]].detail
        )
        return ConditionUpdate(kind, false, reasons.PROTOCOL_UNAVAILABLE, message)
    rdma = [pod for pod, transport in used.items() if transport.protocol is RDMA]
    tcp = [pod for pod, transport in used.items() if transport.protocol is TCP]
    if rdma and tcp:
        message = reasons.PROTOCOLS_DIFFER_MESSAGE.format(
            requested=requested.value, rdma=reasons.listing(rdma), tcp=reasons.listing(tcp)
        )
        return ConditionUpdate(kind, false, reasons.PROTOCOLS_DIFFER, message)
    first = next(iter(used))
    reason, template = (
        (reasons.USING_RDMA, reasons.USING_RDMA_MESSAGE)
        if used[first].protocol is RDMA
        else (reasons.USING_TCP, reasons.USING_TCP_MESSAGE)
    )
    message = template.format(
        count=len(used), requested=requested.value, pod=first, detail=used[first].detail
    )
    return ConditionUpdate(kind, ConditionStatus.TRUE, reason, message)
