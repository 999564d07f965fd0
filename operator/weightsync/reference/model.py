"""A Llama-shaped decoder (RMSNorm, rotary, GQA attention, SwiGLU MLP), built from a config.

Parameter names follow the Hugging Face Llama layout (`model.layers.0.self_attn.q_proj.weight`,
`lm_head.weight`), so a state dict looks like the ones real engines load. With experts in
the config the MLP becomes a Qwen3-MoE sparse block (`mlp.gate`, `mlp.experts.N.*`, top-k
routing) and attention gains Qwen3's per-head q/k norms: a Qwen3-30B-A3B-shaped state dict
has 18,867 tensors, the many-tensor case the transfer must keep fast. The trainer side
of tests, the demo and the benchmarks build the same class with `build_model`, so greedy
outputs of trainer and engine can be compared token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from weightsync.transfer.layout import TensorMeta


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    head_size: int | None = None  # None: hidden_size // num_heads (Llama); Qwen3 sets it
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    num_experts: int = 0  # 0: a dense MLP; else a sparse MoE block in every layer
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    def validate(self) -> None:
        if self.head_size is None and self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError("experts_per_token must be in 1..num_experts")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    ),
    # The real vLLM and SGLang CPU servers' model (tests/engines_real): vLLM's CPU attention
    # needs a head size of at least 32.
    "tiny-hd32": ModelConfig(
        vocab_size=256,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
    ),
    # Sizes that do not divide by 2 or 4 (vocabulary 250, MLP 90): shards come out uneven.
    "uneven": ModelConfig(
        vocab_size=250,
        hidden_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=90,
    ),
    "small": ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1408,
    ),
    # Llama-3-8B's shapes: 291 tensors, 8.03e9 parameters (16.06 GB in bf16).
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
    ),
    # Qwen3-30B-A3B's shapes: 48 layers of 128 experts, 18,867 tensors, 61.1 GB in bf16.
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        intermediate_size=6144,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        head_size=128,
        qk_norm=True,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
    ),
    # The same structure at test size (routing, q/k norms, expert tensors).
    "tiny-moe": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        head_size=32,
        qk_norm=True,
        num_experts=4,
        experts_per_token=2,
        moe_intermediate_size=48,
    ),
}


def preset(name: str, layers: int | None = None) -> ModelConfig:
    """A preset, optionally cut to its first `layers` layers: the same tensor shapes in a
    model that fits a smaller GPU (benchmarks)."""
    config = PRESETS[name]
    if layers is None:
        return config
    if not 0 < layers <= config.num_layers:
        raise ValueError(f"layers must be in 1..{config.num_layers} for {name}")
    return replace(config, num_layers=layers)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotary(length: int, config: ModelConfig, device: torch.device) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    )
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((angles, angles), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        head, kv = config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * head, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(config.num_heads * head, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(head, config.rms_norm_eps)
            self.k_norm = RMSNorm(head, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        repeat = cfg.num_heads // cfg.num_kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        return projected


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class SparseMoE(nn.Module):
    """Qwen3-MoE's block: softmax router, top-k experts, their weights renormalised."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        for expert in torch.unique(chosen).tolist():  # only the experts some token chose
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            mixed = self.experts[expert](flat[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, mixed)
        return out.view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoE(config)
            if config.num_experts
            else MLP(config.hidden_size, config.intermediate_size)
        )

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), angles)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.model.embed_tokens(input_ids)
        angles = _rotary(input_ids.shape[1], self.config, input_ids.device)
        for layer in self.model.layers:
            x = layer(x, angles)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> None:
    """Deterministic weights from `seed`, independent of device and thread count."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        # Norm weights near one, projections small: outputs stay sensible at any depth.
        values = 1.0 + 0.1 * values if name.endswith("norm.weight") else 0.02 * values
        param.copy_(values.to(param.dtype))


def build_model(
    config: ModelConfig,
    seed: int | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """The model with deterministic weights from `seed`, in eval mode, gradients off.

    `seed=None` leaves the weights uninitialised: for benchmarks of 8B shapes, whose
    weights arrive by the first sync round anyway.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)  # no float32 copy on the device
    if seed is not None:
        randomize(model, seed)
    model.requires_grad_(False)
    return model.eval()


def state_dict_metas(config: ModelConfig, dtype: str = "bfloat16") -> list[TensorMeta]:
    """Names and shapes of the model's parameters, in order, without allocating them."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [TensorMeta(name, tuple(p.shape), dtype) for name, p in model.named_parameters()]


@torch.no_grad()
def greedy_generate(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy decoding, one prompt at a time (no KV cache: the reference favours clarity)."""
    device = next(model.parameters()).device
    outputs: list[list[int]] = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        generated: list[int] = []
        for _ in range(max_new_tokens):
            next_id = int(model(ids)[0, -1].argmax().item())
            generated.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
        outputs.append(generated)
    return outputs
