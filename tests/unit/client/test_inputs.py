"""The Publisher's input checks, and their shortcut for the same tensors again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightsync.client.inputs import Accepted, PublishInputError, checked_tensors
from weightsync.engines.reference.model import PRESETS, build_model


@pytest.fixture
def params() -> dict[str, torch.Tensor]:
    return dict(build_model(PRESETS["tiny"], seed=0).named_parameters())


def test_the_same_tensors_again_pass_as_the_same_dict(params: dict[str, torch.Tensor]) -> None:
    first = checked_tensors(params)
    accepted = Accepted.of(first)
    assert checked_tensors(params, accepted) is first
    assert checked_tensors(list(params.items()), accepted) is first
    assert checked_tensors(iter(params.items()), accepted) is first  # named_parameters()


def test_a_tensor_changed_in_any_way_is_checked_again(params: dict[str, torch.Tensor]) -> None:
    accepted = Accepted.of(checked_tensors(params))
    name = "model.layers.0.mlp.up_proj.weight"
    param = params[name]
    served = param.data

    other = {**params, name: served.clone()}  # another object under the name
    again = checked_tensors(other, accepted)
    assert again is not accepted.tensors
    assert again[name] is other[name]

    param.data = served.view(-1)  # the same storage, another shape
    assert checked_tensors(params, accepted) is not accepted.tensors
    param.data = torch.empty(served.shape, dtype=torch.float8_e4m3fnuz)  # a dtype not sent
    with pytest.raises(PublishInputError, match=f"tensor {name!r}: dtype float8_e4m3fnuz"):
        checked_tensors(params, accepted)
    param.data = served
    assert checked_tensors(params, accepted) is accepted.tensors

    with pytest.raises(PublishInputError, match=r"expected a torch\.Tensor"):
        checked_tensors({**params, name: np.zeros(3)}, accepted)
    pairs = [list(pair) for pair in params.items()]  # the same objects, not as pairs
    with pytest.raises(PublishInputError, match=r"expected a \(name, tensor\) pair"):
        checked_tensors(pairs, accepted)  # type: ignore[arg-type]
    renamed = {("x." + n if n == name else n): t for n, t in params.items()}
    assert list(checked_tensors(renamed, accepted)) == list(renamed)
