"""The reference model's MoE presets: Qwen3-30B-A3B's shapes, routing, a synced update."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from weightsync.reference.engine import ReferenceEngine
from weightsync.reference.model import (
    PRESETS,
    SparseMoE,
    build_model,
    greedy_generate,
    state_dict_metas,
)
from weightsync.transfer.buffers import BucketSlots, copy_tensors, slot_views
from weightsync.transfer.layout import plan_layout

TINY_MOE = PRESETS["tiny-moe"]


def test_the_30b_preset_has_qwen3_30b_a3b_tensors() -> None:
    metas = state_dict_metas(PRESETS["qwen3-30b-a3b"])
    shapes = {m.name: m.shape for m in metas}
    assert len(metas) == len(shapes) == 18_867
    assert round(sum(m.nbytes for m in metas) / 1e9, 1) == 61.1
    assert shapes["model.embed_tokens.weight"] == (151936, 2048)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (2048, 4096)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert shapes["lm_head.weight"] == (151936, 2048)
    assert not any(".mlp.gate_proj." in name for name in shapes)  # no dense MLP beside


def test_each_token_mixes_its_top_k_experts_by_renormalised_router_weights() -> None:
    block = build_model(TINY_MOE, seed=3).model.layers[0].mlp
    assert isinstance(block, SparseMoE)
    x = torch.randn(2, 5, TINY_MOE.hidden_size, generator=torch.Generator().manual_seed(0))
    got = block(x).reshape(-1, TINY_MOE.hidden_size)
    for token, row in enumerate(x.reshape(-1, TINY_MOE.hidden_size)):
        probs = F.softmax(block.gate(row).float(), dim=-1)
        top = probs.topk(TINY_MOE.experts_per_token)
        want = sum(
            (weight / top.values.sum()) * block.experts[int(expert)](row)
            for weight, expert in zip(top.values, top.indices, strict=True)
        )
        torch.testing.assert_close(got[token], want)


def test_an_moe_model_synced_into_the_engine_generates_like_the_trainers(tmp_path: Path) -> None:
    engine = ReferenceEngine(build_model(TINY_MOE, seed=0))
    layout = plan_layout(state_dict_metas(TINY_MOE, "float32"), 8 << 10)
    slots = BucketSlots(2, layout.capacity_bytes, torch.device("cpu"), str(tmp_path))
    engine.attach(slots.handles)
    trainer = build_model(TINY_MOE, seed=7)
    source = dict(trainer.named_parameters())
    engine.begin(1)
    for bucket in layout.buckets:
        slot = bucket.index % 2
        views = slot_views(slots.slots[slot], bucket.tensors)
        copy_tensors(views, [source[t.name] for t in bucket.tensors])
        engine.load(slot, bucket.tensors)
    engine.commit(1)
    prompts = [[1, 2, 3], [200, 7]]
    outputs, version = engine.generate(prompts, 4)
    assert version == 1
    assert outputs == greedy_generate(trainer, prompts, 4)
    assert outputs != greedy_generate(build_model(TINY_MOE, seed=0), prompts, 4)
