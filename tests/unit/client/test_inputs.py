"""The Publisher's input checks, and their shortcut for the same tensors again."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from weightsync.client.inputs import Accepted, PublishInputError, checked_tensors
from weightsync.reference.model import PRESETS, build_model


@pytest.fixture
def params() -> dict[str, torch.Tensor]:
    return dict(build_model(PRESETS["tiny"], seed=0).named_parameters())


def test_the_same_tensors_again_pass_unchecked(params: dict[str, torch.Tensor]) -> None:
    first, again = checked_tensors(params)
    assert not again
    accepted = Accepted.of(first)
    for same in (params, list(params.items()), iter(params.items())):  # named_parameters()
        tensors, again = checked_tensors(same, accepted)
        assert again
        assert list(tensors) == list(params)
        assert all(tensors[n] is t for n, t in params.items())


def test_a_tensor_changed_in_any_way_is_checked_again(params: dict[str, torch.Tensor]) -> None:
    accepted = Accepted.of(checked_tensors(params)[0])
    name = "model.layers.0.mlp.up_proj.weight"
    param = params[name]
    served = param.data

    other = {**params, name: served.clone()}  # another object under the name
    tensors, again = checked_tensors(other, accepted)
    assert not again
    assert tensors[name] is other[name]

    param.data = served.view(-1)  # the same storage, another shape
    assert not checked_tensors(params, accepted)[1]
    param.data = torch.empty(served.shape, dtype=torch.float8_e4m3fnuz)  # a dtype not sent
    with pytest.raises(PublishInputError, match=f"tensor {name!r}: dtype float8_e4m3fnuz"):
        checked_tensors(params, accepted)
    param.data = served
    assert checked_tensors(params, accepted)[1]

    with pytest.raises(PublishInputError, match=r"expected a torch\.Tensor"):
        checked_tensors({**params, name: np.zeros(3)}, accepted)
    pairs = [list(pair) for pair in params.items()]  # the same objects, not as pairs
    with pytest.raises(PublishInputError, match=r"expected a \(name, tensor\) pair"):
        checked_tensors(pairs, accepted)  # type: ignore[arg-type]
    renamed = {("x." + n if n == name else n): t for n, t in params.items()}
    assert list(checked_tensors(renamed, accepted)[0]) == list(renamed)


def test_accepted_tensors_are_not_kept_alive() -> None:
    """A trainer that publishes fresh copies each step must not hold two sets."""
    copies = {"w": torch.ones(4), "b": torch.zeros(2)}
    accepted = Accepted.of(checked_tensors(copies)[0])
    gone = weakref.ref(copies["w"])
    del copies
    gc.collect()
    assert gone() is None
    fresh = {"w": torch.ones(4), "b": torch.zeros(2)}
    assert not checked_tensors(fresh, accepted)[1]
