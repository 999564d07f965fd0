"""What a real engine serves, asked of the engine itself: its weights and greedy output.

vLLM's CPU build packs every linear layer's weight for oneDNN and drops the original, so
its checksum route hashes an empty tensor for them: bit-exact checks cover the tensors
vLLM keeps as loaded (embedding, norms, lm_head); greedy output checks the rest. SGLang
reads every tensor back.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.engines_real.rig import (
    PROMPT,
    get_json,
    post_json,
    reference_tokens,
    sha256,
    trainer,
)
from weightsync.reference.model import LlamaForCausalLM

Weights = dict[str, torch.Tensor]
KEPT_AS_LOADED = 7  # vLLM: embed_tokens, 2 x 2 layer norms, norm, lm_head
EMPTY = sha256(torch.empty(0))


def model_of(weights: Weights) -> LlamaForCausalLM:
    """The reference model holding `weights`: its greedy output is the expected one."""
    model = trainer(0)
    model.load_state_dict(weights, strict=True)
    return model


def generate(url: str, prompt: list[int], count: int) -> dict[str, object]:
    """SGLang's native generation."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": count, "temperature": 0, "ignore_eos": True},
    }
    reply: dict[str, object] = post_json(f"{url}/generate", body)
    return reply


def completion(url: str, prompt: list[int], count: int, **extra: Any) -> dict[str, Any]:
    """vLLM's OpenAI completion, with token ids."""
    body = {
        "model": "model",
        "prompt": prompt,
        "max_tokens": count,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    reply: dict[str, Any] = post_json(f"{url}/v1/completions", body)
    return reply


def read_back(url: str, name: str, like: torch.Tensor) -> torch.Tensor:
    values = post_json(f"{url}/get_weights_by_name", {"name": name, "truncate_size": like.shape[0]})
    return torch.tensor(values, dtype=torch.float32).reshape(like.shape)


def assert_sglang_serves(url: str, weights: Weights, version: int) -> None:
    """Every tensor reads back bit-exact; greedy output equals the reference model's."""
    for name, tensor in weights.items():
        assert torch.equal(read_back(url, name, tensor), tensor), name
    reply = generate(url, PROMPT, 8)
    assert reply["output_ids"] == reference_tokens(model_of(weights), PROMPT, 8)
    meta = reply["meta_info"]
    assert isinstance(meta, dict)
    assert meta["weight_version"] == str(version)


def assert_vllm_serves(url: str, weights: Weights, version: int) -> None:
    """The tensors vLLM keeps as loaded hash as sent; greedy output is the reference's."""
    sums = post_json(f"{url}/weight_checker", {"action": "checksum"})["checksums"]
    served = {key.rsplit(":", 1)[-1]: value for key, value in sums.items()}
    # Packed linear layers hash as an empty tensor; every other tensor as it was loaded.
    packed = {name for name, value in served.items() if value == EMPTY}
    assert all(name.endswith("_proj.weight") for name in packed), sorted(packed)
    kept = set(served) - packed
    assert len(kept) == KEPT_AS_LOADED, sorted(served)
    for name in kept:
        assert served[name] == sha256(weights[name]), name
    choice = completion(url, PROMPT, 8)["choices"][0]
    assert choice["token_ids"] == reference_tokens(model_of(weights), PROMPT, 8)
    assert get_json(f"{url}/weight_info") == {"weight_version": str(version)}


def assert_generates(engine: str, url: str) -> None:
    """The engine answers a new request (a paused one would hold it)."""
    if engine == "vllm":
        assert len(completion(url, PROMPT, 2)["choices"][0]["token_ids"]) == 2
    else:
        output = generate(url, PROMPT, 2)["output_ids"]
        assert isinstance(output, list)
        assert len(output) == 2


def resumed_on_new_weights(tokens: list[int], old_tokens: list[int], new: LlamaForCausalLM) -> int:
    """Where `tokens` switched from the old weights' greedy output to the new weights'
    continuation of what came before: the number of old tokens, asserted to exist."""
    split = next(i for i, (a, b) in enumerate(zip(tokens, old_tokens, strict=True)) if a != b)
    # The switch is at or before the first token that differs (tokens may agree by chance).
    for k in range(split, 0, -1):
        if tokens[k:] == reference_tokens(new, PROMPT + tokens[:k], len(tokens) - k):
            return k
    raise AssertionError(f"no point where the new weights took over: {tokens}")


ASSERT_SERVES = {"vllm": assert_vllm_serves, "sglang": assert_sglang_serves}
