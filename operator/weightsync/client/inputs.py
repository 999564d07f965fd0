"""What `Publisher.publish` accepts, checked before anything reaches the agent.

Each refusal names the tensor (or the argument) and the rule it breaks, so a trainer's
bug reads as one line, and nothing half-sent leaves the Publisher's connection out of
step for the next call.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from weightsync.client.shards import ShardError, check_placements, describe, is_sharded
from weightsync.transfer.buffers import dtype_name
from weightsync.transfer.handoff import Boxes
from weightsync.transfer.layout import DTYPE_ITEMSIZE, TensorMeta


class PublishInputError(ValueError):
    """`publish` was given something it cannot send; the message names what and why.
    Raised before anything reaches the agent: the Publisher stays usable."""


_DATA_PTR = torch.Tensor.data_ptr


def held(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds of `tensor`: a DTensor's own shard (the tensor `to_local()`
    views, without a new view object per call), a plain tensor itself."""
    local = getattr(tensor, "_local_tensor", None)  # DTensor's own: to_local() views it
    if isinstance(local, torch.Tensor):
        return local
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


@dataclass(frozen=True, slots=True)
class Accepted:
    """A call's tensors as they passed the checks: the same tensor objects, still at the
    same addresses with the same shapes and dtypes, pass again without them. A DTensor's
    address is its own shard's: the same DTensor object (its mesh and placements fixed)
    over a shard at the same address holds the same block.

    Compared by `map` over C functions, not a Python loop per tensor: a trainer publishes
    the same parameters every step, and the loop cost about 2 us a tensor (40 ms a call
    for a 30B MoE's 18,867 tensors). An object whose `.data` was replaced has a new
    address, shape or dtype, and is checked again. The tensors are held weakly: a
    Publisher must not keep a trainer's old tensors alive between calls."""

    names: list[str]
    refs: list[weakref.ref[torch.Tensor]]
    addresses: list[int]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    plain: bool  # no DTensor among them: each tensor's address is its own

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Accepted:
        values = list(tensors.values())
        return cls(
            list(tensors),
            list(map(weakref.ref, values)),
            list(map(_DATA_PTR, map(held, values))),
            list(map(_SHAPE, values)),
            list(map(_DTYPE, values)),
            not any(isinstance(v, DTensor) for v in values),
        )

    def matches(self, names: list[Any], values: list[Any]) -> bool:
        try:
            return (
                names == self.names
                and len(values) == len(self.refs)
                and all(map(operator.is_, values, map(operator.call, self.refs)))
                and list(map(_DATA_PTR, values if self.plain else map(held, values)))
                == self.addresses
                and list(map(_SHAPE, values)) == self.shapes
                and list(map(_DTYPE, values)) == self.dtypes
            )
        except (TypeError, RuntimeError):  # not tensors (or sparse ones): the checks say so
            return False


def _split(pairs: list[Any]) -> tuple[list[Any], list[Any]] | None:
    """Names and values of (name, value) pairs, or None where the checks would refuse."""
    if set(map(type, pairs)) != {tuple} or set(map(len, pairs)) != {2}:
        return None
    return list(map(operator.itemgetter(0), pairs)), list(map(operator.itemgetter(1), pairs))


def checked_tensors(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    last: Accepted | None = None,
) -> tuple[dict[str, torch.Tensor], bool]:
    """`named_tensors` as an ordered dict, every name once, every value a tensor we send,
    and whether they are `last`'s tensors again, unchanged (then nothing was checked)."""
    if isinstance(named_tensors, torch.Tensor | str | bytes):
        raise PublishInputError(
            "named_tensors: expected a mapping or (name, tensor) pairs, such as"
            f" model.named_parameters(); got {type(named_tensors).__name__}"
        )
    if isinstance(named_tensors, Mapping):
        names, values = list(named_tensors.keys()), list(named_tensors.values())
        if last is not None and last.matches(names, values):
            return dict(named_tensors), True
        pairs = list(zip(names, values, strict=True))
    else:
        try:
            pairs = list(named_tensors)
        except TypeError as exc:
            raise PublishInputError(
                f"named_tensors: expected a mapping or (name, tensor) pairs: {exc}"
            ) from exc
        split = _split(pairs) if last is not None else None
        if last is not None and split is not None and last.matches(*split):
            return dict(pairs), True
    tensors: dict[str, torch.Tensor] = {}
    for index, pair in enumerate(pairs):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise PublishInputError(f"named_tensors[{index}]: expected a (name, tensor) pair")
        name, tensor = pair
        if not isinstance(name, str) or not name:
            raise PublishInputError(
                f"named_tensors[{index}]: a name is a non-empty str, got {name!r}"
            )
        if name in tensors:
            raise PublishInputError(f"tensor {name!r}: named twice; every name must be unique")
        tensors[name] = check_tensor(name, tensor)
    if not tensors:
        raise PublishInputError("named_tensors: nothing to publish")
    return tensors, False


# torch.dtype -> its name, for the dtypes the wire format carries (a dict lookup per tensor:
# publish() checks every tensor of every call, 18,867 of them for a 30B MoE).
_PUBLISHABLE = {getattr(torch, n): n for n in DTYPE_ITEMSIZE if hasattr(torch, n)}


def check_tensor(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        kind = f"{type(tensor).__module__}.{type(tensor).__name__}"
        raise PublishInputError(f"tensor {name!r}: expected a torch.Tensor, got {kind}")
    if tensor.dtype not in _PUBLISHABLE:
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise PublishInputError(f"tensor {name!r}: dtype {dtype} cannot be published")
    if tensor.layout is not torch.strided:  # sparse COO/CSR and the like
        raise PublishInputError(f"tensor {name!r}: only dense (strided) tensors are published")
    if type(tensor) is torch.Tensor:
        return tensor
    if not isinstance(tensor, torch.nn.Parameter | DTensor):
        raise PublishInputError(
            f"tensor {name!r}: a {type(tensor).__name__} is not a plain tensor, a Parameter or"
            " a DTensor"
        )
    if isinstance(tensor, DTensor):
        try:
            check_placements(name, tensor)
        except ShardError as exc:
            raise PublishInputError(str(exc)) from None
    return tensor


@dataclass(frozen=True, slots=True)
class Described:
    """A tensor set as this rank publishes it."""

    metas: list[TensorMeta]  # the global tensors
    boxes: Boxes | None  # None: every tensor held whole
    local: dict[str, torch.Tensor]  # this rank's bytes of each tensor it holds
    signature: list[object]


@dataclass(frozen=True, slots=True)
class Kept:
    """The last tensors accepted and how they were described: the same again skip both."""

    accepted: Accepted
    metas: list[TensorMeta]
    signature: list[object]
    boxes: Boxes | None = None  # a sharded set's blocks, as attached
    local: list[str] | None = None  # a sharded set: the names of the tensors with a block

    def described(self, tensors: dict[str, torch.Tensor]) -> Described:
        """The kept description of `tensors` (the accepted ones again): a sharded set's
        local blocks are its DTensors' shards, which describing found contiguous."""
        if self.local is None:
            return Described(self.metas, None, tensors, self.signature)
        local = {name: held(tensors[name]) for name in self.local}
        return Described(self.metas, self.boxes, local, self.signature)


def kept_of(tensors: dict[str, torch.Tensor], described: Described) -> Kept | None:
    """What to keep of a call for the next: nothing for a sharded set whose blocks are
    not their DTensors' own shards (a non-contiguous shard is copied when described)."""
    accepted = Accepted.of(tensors)
    if described.boxes is None:
        return Kept(accepted, described.metas, described.signature)
    local = list(described.local)
    for name in local:  # `to_local()` views the shard; `.contiguous()` would have copied
        block, shard = described.local[name], held(tensors[name])
        if block.data_ptr() != shard.data_ptr() or block.shape != shard.shape:
            return None
    return Kept(accepted, described.metas, described.signature, described.boxes, local)


def tensor_addresses(tensors: dict[str, torch.Tensor]) -> list[int]:
    """Where each tensor's data lies (a moved tensor must be shared again)."""
    return list(map(_DATA_PTR, tensors.values()))


def checked_version(version: object, last: int | None) -> int:
    """`version` if it is a step number above `last` (the last one published)."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise PublishInputError(
            f"version: must be an int (a step number), got {type(version).__name__} {version!r}"
        )
    if version < 0:
        raise PublishInputError(f"version: must be >= 0, got {version}")
    if last is not None and version <= last:
        raise PublishInputError(
            f"version: must be above {last}, the last this Publisher published, got"
            f" {version} (a trainer that restarts from an earlier step makes a new"
            " Publisher: a new lineage)"
        )
    return version


def describe_tensors(
    tensors: dict[str, torch.Tensor],
    metas: list[TensorMeta] | None,
    signature: list[object],
    boxes: Boxes | None,
) -> Described:
    """The tensor set as a rank publishes it; metadata is rebuilt only when names, shapes,
    dtypes or held blocks changed from `signature` (then the Publisher attaches again)."""
    if not is_sharded(tensors.values()):
        whole: list[object] = [(name, t.shape, t.dtype) for name, t in tensors.items()]
        if metas is not None and whole == signature and boxes is None:
            return Described(metas, None, tensors, whole)
        fresh = [TensorMeta(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()]
        return Described(fresh, None, tensors, whole)
    try:
        pieces = [describe(name, t) for name, t in tensors.items()]
    except ShardError as exc:  # nothing was sent: the Publisher stays usable
        raise PublishInputError(str(exc)) from None
    held_boxes: Boxes = [(list(p.box.offset), list(p.box.shape)) if p.box else None for p in pieces]
    local = {p.meta.name: p.local for p in pieces if p.local is not None}
    sharded: list[object] = [(p.meta, p.box) for p in pieces]
    if metas is not None and sharded == signature:
        return Described(metas, boxes, local, sharded)
    return Described([p.meta for p in pieces], held_boxes, local, sharded)
