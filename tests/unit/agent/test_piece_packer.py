"""The agent's packing of a sharded rank's pieces (`agent.packing.PiecePacker`).

On CPU here: the packer's copies are the same on every device; the CUDA mapping of the
Publisher's tensors (`map_packer`) runs in tests/gpu/test_sharded_nccl.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync.agent.packing import PiecePacker, held_blocks
from weightsync.agent.rounds import RoundFailed
from weightsync.transfer.layout import TensorMeta


async def _run(call):  # the collective thread, inline
    return call()


def _blocks() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "b": torch.arange(5, dtype=torch.float32) + 0.5,
    }


def test_held_blocks_take_each_box_shape_and_skip_what_a_rank_does_not_hold() -> None:
    metas = [
        TensorMeta("w", (6, 4), "bfloat16"),
        TensorMeta("b", (5,), "float32"),
        TensorMeta("e", (8, 2), "float16"),
    ]
    boxes = [([3, 0], [3, 4]), ([0], [5]), None]
    assert held_blocks(metas, boxes) == [("w", (3, 4), "bfloat16"), ("b", (5,), "float32")]
    assert held_blocks(metas, None) == [(m.name, m.shape, m.dtype) for m in metas]


def test_pieces_land_at_their_offsets_byte_for_byte() -> None:
    blocks = _blocks()
    slots = [torch.zeros(256, dtype=torch.uint8) for _ in range(2)]
    packer = PiecePacker(blocks)
    channel = packer.channel(slots, _run)
    asyncio.run(channel.fill(3, 1, [("b", 0), ("w", 64)]))
    assert torch.equal(slots[1][0:20], blocks["b"].view(torch.uint8))
    assert torch.equal(slots[1][64:88], blocks["w"].reshape(-1).view(torch.uint8))
    assert int(slots[1][20:64].count_nonzero()) == 0
    assert int(slots[0].count_nonzero()) == 0
    # The trainer writes its tensors in place; the next round packs the new bytes.
    blocks["w"].add_(1)
    asyncio.run(channel.fill(3, 1, [("b", 0), ("w", 64)]))
    assert torch.equal(slots[1][64:88], blocks["w"].reshape(-1).view(torch.uint8))


def test_a_new_plan_moves_the_pieces_and_new_slots_drop_the_old_views() -> None:
    blocks = _blocks()
    slots = [torch.zeros(128, dtype=torch.uint8)]
    packer = PiecePacker(blocks)
    asyncio.run(packer.channel(slots, _run).fill(0, 0, [("w", 0)]))
    asyncio.run(packer.channel(slots, _run).fill(0, 0, [("w", 32)]))  # same slot, new plan
    assert torch.equal(slots[0][32:56], blocks["w"].reshape(-1).view(torch.uint8))
    grown = [torch.zeros(256, dtype=torch.uint8)]
    asyncio.run(packer.channel(grown, _run).fill(0, 0, [("w", 200)]))
    assert torch.equal(grown[0][200:224], blocks["w"].reshape(-1).view(torch.uint8))
    assert int(grown[0][:200].count_nonzero()) == 0


def test_a_piece_this_rank_does_not_hold_fails_the_round_naming_it() -> None:
    channel = PiecePacker(_blocks()).channel([torch.zeros(64, dtype=torch.uint8)], _run)
    with pytest.raises(RoundFailed, match="'e'"):
        asyncio.run(channel.fill(0, 0, [("e", 0)]))
    with pytest.raises(RoundFailed, match="pieces"):
        asyncio.run(channel.fill(0, 0, None))
