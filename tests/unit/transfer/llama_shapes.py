"""Llama-3-8B parameter shapes written out by hand, independent of the reference model."""

from __future__ import annotations

from weightsync.transfer.layout import TensorMeta

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 4096, 32, 32, 8, 14336, 128256


def llama3_8b_metas(dtype: str = "bfloat16") -> list[TensorMeta]:
    kv = HIDDEN // HEADS * KV_HEADS
    out = [TensorMeta("model.embed_tokens.weight", (VOCAB, HIDDEN), dtype)]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out += [
            TensorMeta(f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN), dtype),
            TensorMeta(f"{p}.self_attn.k_proj.weight", (kv, HIDDEN), dtype),
            TensorMeta(f"{p}.self_attn.v_proj.weight", (kv, HIDDEN), dtype),
            TensorMeta(f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN), dtype),
            TensorMeta(f"{p}.mlp.gate_proj.weight", (FFN, HIDDEN), dtype),
            TensorMeta(f"{p}.mlp.up_proj.weight", (FFN, HIDDEN), dtype),
            TensorMeta(f"{p}.mlp.down_proj.weight", (HIDDEN, FFN), dtype),
            TensorMeta(f"{p}.input_layernorm.weight", (HIDDEN,), dtype),
            TensorMeta(f"{p}.post_attention_layernorm.weight", (HIDDEN,), dtype),
        ]
    out += [
        TensorMeta("model.norm.weight", (HIDDEN,), dtype),
        TensorMeta("lm_head.weight", (VOCAB, HIDDEN), dtype),
    ]
    return out
