"""What `Publisher.publish` accepts, checked before anything reaches the agent.

Each refusal names the tensor (or the argument) and the rule it breaks, so a trainer's
bug reads as one line, and nothing half-sent leaves the Publisher's connection out of
step for the next call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch.distributed.tensor import DTensor

from weightsync.client.shards import ShardError, check_placements
from weightsync.transfer.layout import DTYPE_ITEMSIZE


class PublishInputError(ValueError):
    """`publish` was given something it cannot send; the message names what and why.
    Raised before anything reaches the agent: the Publisher stays usable."""


def checked_tensors(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """`named_tensors` as an ordered dict, every name once, every value a tensor we send."""
    if isinstance(named_tensors, torch.Tensor | str | bytes):
        raise PublishInputError(
            "named_tensors: expected a mapping or (name, tensor) pairs, such as"
            f" model.named_parameters(); got {type(named_tensors).__name__}"
        )
    try:
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    except TypeError as exc:
        raise PublishInputError(
            f"named_tensors: expected a mapping or (name, tensor) pairs: {exc}"
        ) from exc
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
    return tensors


def check_tensor(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        kind = f"{type(tensor).__module__}.{type(tensor).__name__}"
        raise PublishInputError(f"tensor {name!r}: expected a torch.Tensor, got {kind}")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPE_ITEMSIZE:
        raise PublishInputError(f"tensor {name!r}: dtype {dtype} cannot be published")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise PublishInputError(f"tensor {name!r}: only dense (strided) tensors are published")
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter | DTensor):
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
