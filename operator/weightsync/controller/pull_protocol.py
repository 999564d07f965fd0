"""Which P2P protocol each agent's recovery pulls use, and over which holders. Pure.

Each agent resolves `spec.recovery.protocol` itself at start (`Auto`: RDMA where its
container can open an RDMA device and register memory, else TCP) and reports the result
(`AgentStatus.recovery_transport`). A holder serves one protocol. TCP needs nothing but
the transfer engine, so a puller on RDMA can read TCP holders as well; a puller on TCP
cannot read an RDMA holder. So a pull uses RDMA when the puller and some holders are on
RDMA, else TCP from the holders on TCP, and a pod with no holder it can read waits for
the next round, as when nobody holds. Members on different protocols (some pods given
RDMA devices, some not) are legal but a misconfiguration.

An agent older than the report is taken to use what its environment says: the spec's
protocol when explicit, and TCP under Auto (the webhook writes no protocol for Auto, and
such an agent's default is TCP).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightsync.api.control import AgentStatus, RecoveryTransport
from weightsync.api.v1alpha1 import RecoveryProtocol

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
