"""The control API's protocol version and its skew policy. Pure.

Operator and agents are released together but never upgraded together: a `helm upgrade`
replaces the operator at once, while each agent is a sidecar that changes only when its
pod is recreated (which restarts its engine). So operator N meets agents of other
releases, and works with agents N-1, N and N+1:

* **Versions.** Every request of the operator carries its version in the
  `Weightsync-Protocol` header; every agent reports its own in `AgentStatus.protocol_version`
  (sent only to a requester whose version knows the field). The agents released before
  versions existed send neither: an absent version is version 1 (`OLDEST`).
* **The sender drops what the peer does not know.** `ADDED` names every message field
  added after version 1 with the version that added it. The operator sends a field only
  to an agent whose reported version knows it, and refuses to send a request whose
  dropped field holds anything but its default (the agent could not do what it asks:
  the delivery fails, with the field named). An agent likewise leaves out of its status
  the fields the requesting operator's version lacks (both sides forbid unknown fields).
  Status fields of version 1 that came late are still sent only when asked (`?with=`,
  `control.STATUS_ADDITIONS`), for the operators that send no version.
* **The receiver tolerates a newer sender.** An agent ignores (and logs once) fields it
  does not know in a request from an operator of a newer version, and refuses them (400,
  naming the field) from one of its own version or older: there they are typos.
* **Beyond one version apart.** An agent whose version is more than one away from the
  operator's is not planned and not recovered; the WeightSync reports it (Degraded,
  `AgentProtocolSkew`) until its pod is recreated with the operator's agent image.

Bump `PROTOCOL_VERSION` with every release that changes a message, and add the new
fields to `ADDED` under it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

PROTOCOL_VERSION = 2
OLDEST = 1  # the agents released before versions: they report none
HEADER = "Weightsync-Protocol"
SKEW = 1  # how many versions apart operator and agent still work together

# `Message.field` -> the version that added it; the one table of the policy.
ADDED: Mapping[str, int] = {
    "AgentStatus.protocol_version": 2,
}

MessageT = TypeVar("MessageT", bound=BaseModel)


def within_skew(peer: int, own: int = PROTOCOL_VERSION) -> bool:
    """Whether a peer of version `peer` works with this side (`own`)."""
    return abs(peer - own) <= SKEW


def out_of_skew(versions: Mapping[str, int], own: int = PROTOCOL_VERSION) -> dict[str, int]:
    """The peers (by name, of `versions`) more than `SKEW` versions from `own`."""
    return {name: version for name, version in versions.items() if not within_skew(version, own)}


def sender_version(header: str | None) -> int:
    """The version a request's `HEADER` gives; `OLDEST` when it has none. ValueError when
    it is no positive integer."""
    if header is None:
        return OLDEST
    version = int(header.strip())
    if version < OLDEST:
        raise ValueError(f"protocol version {version} is below {OLDEST}")
    return version


@dataclass(frozen=True, slots=True)
class ForPeer:
    """A message as a peer of some version reads it: `data` (JSON-ready) without the
    fields the peer lacks; `lost` names those of them that held a non-default value (or
    have no default), as dotted paths without list indices."""

    data: dict[str, Any]
    lost: tuple[str, ...] = ()

    def json(self) -> str:
        return json.dumps(self.data, separators=(",", ":"))


def for_peer(
    message: BaseModel,
    peer: int,
    *,
    exclude: frozenset[str] = frozenset(),
    added: Mapping[str, int] | None = None,
) -> ForPeer:
    """`message` for a peer of version `peer` (top-level fields in `exclude` left out too);
    `added`: the table of new fields, `ADDED` by default."""
    if added is None:
        added = ADDED
    data = message.model_dump(mode="json", exclude=set(exclude) or None)
    if all(version <= peer for version in added.values()):
        return ForPeer(data)  # the usual case: nothing to look at
    lost: list[str] = []

    def drop(message: BaseModel, data: dict[str, Any], path: str) -> None:
        """Drop from `data` (`message` dumped) the fields `peer` lacks, nested ones too."""
        kind = type(message)
        for name, info in kind.model_fields.items():
            if name not in data:
                continue
            value = getattr(message, name)
            if added.get(f"{kind.__name__}.{name}", OLDEST) > peer:
                del data[name]
                if value != info.get_default(call_default_factory=True):
                    lost.append(f"{path}{name}")
            elif isinstance(value, BaseModel):
                drop(value, data[name], f"{path}{name}.")
            elif isinstance(value, list):
                for index, item in enumerate(value):
                    if isinstance(item, BaseModel):
                        drop(item, data[name][index], f"{path}{name}.")

    drop(message, data, "")
    return ForPeer(data, tuple(dict.fromkeys(lost)))  # by field, not by list item


def parse_from(
    model: type[MessageT], raw: bytes | str, sender: int, own: int = PROTOCOL_VERSION
) -> tuple[MessageT, tuple[str, ...]]:
    """`raw` as a `model` from a sender of version `sender`, and the unknown fields it
    ignored (dotted paths, list indices left out). Only a newer sender's unknown fields
    are ignored; any other error, or an unknown field from a sender not newer than
    `own`, raises ValidationError."""
    try:
        return model.model_validate_json(raw), ()
    except ValidationError as error:
        if sender <= own:
            raise
        problems = error.errors()
        if any(problem["type"] != "extra_forbidden" for problem in problems):
            raise
        data = json.loads(raw)
        for problem in problems:
            *parents, last = problem["loc"]
            node = data
            try:
                for key in parents:
                    node = node[key]
                del node[last]
            except (KeyError, IndexError, TypeError):
                # A path that is not the JSON's (a union member's tag in it): no guessing.
                raise error from None
        # By field, not by list item: a roster's thousand members share one.
        fields = (".".join(str(k) for k in p["loc"] if not isinstance(k, int)) for p in problems)
        return model.model_validate(data), tuple(dict.fromkeys(fields))
