"""weightsync against a real vLLM 0.32.0 server (the CPU build), weights over /dev/shm.

The bucket bytes reach vLLM through weightsync's "weightsync_shm" weight-transfer backend
(a vLLM plugin); pause, the update session and versions are vLLM's own. One server for
the module; every test leaves it serving, except the last, which kills it.

vLLM's CPU build packs every linear layer's weight for oneDNN and drops the original, so
its checksum route hashes an empty tensor for them: bit-exact checks cover the tensors
vLLM keeps as loaded (embedding, norms, lm_head); greedy output checks the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines_real.agents import publish_versions
from tests.engines_real.replay_real import replay
from tests.engines_real.rig import (
    PROMPT,
    Rig,
    get_json,
    killed_mid_round,
    plan_buckets,
    post_json,
    reference_tokens,
    sha256,
    state,
    stream,
    trainer,
)
from tests.engines_real.servers import EngineServer
from tests.engines_real.test_sglang import resumed_on_new_weights
from weightsync.engines.base import EngineError
from weightsync.engines.vllm import SHM_BACKEND, VLLMAdapter, VLLMSettings
from weightsync.reference.model import LlamaForCausalLM

LONG = 160
KEPT_AS_LOADED = 7  # embed_tokens, 2 x 2 layer norms, norm, lm_head
EMPTY = sha256(torch.empty(0))


def completion(url: str, prompt: list[int], count: int, **extra: Any) -> dict[str, Any]:
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


def assert_serves(url: str, model: LlamaForCausalLM, version: int) -> None:
    sums = post_json(f"{url}/weight_checker", {"action": "checksum"})["checksums"]
    served = {key.rsplit(":", 1)[-1]: value for key, value in sums.items()}
    weights = state(model)
    # Packed linear layers hash as an empty tensor; every other tensor as it was loaded.
    packed = {name for name, value in served.items() if value == EMPTY}
    assert all(name.endswith("_proj.weight") for name in packed), sorted(packed)
    kept = set(served) - packed
    assert len(kept) == KEPT_AS_LOADED, sorted(served)
    for name in kept:
        assert served[name] == sha256(weights[name]), name
    choice = completion(url, PROMPT, 8)["choices"][0]
    assert choice["token_ids"] == reference_tokens(model, PROMPT, 8)
    assert get_json(f"{url}/weight_info") == {"weight_version": str(version)}


@pytest.fixture
def rig(vllm_server: EngineServer) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(**settings: Any) -> Rig:
        adapter = VLLMAdapter(VLLMSettings(base_url=vllm_server.url, **settings))
        made.append(Rig.attach(adapter))
        assert adapter.backend == SHM_BACKEND
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_agent_syncs_three_versions(vllm_server: EngineServer, tmp_path: Path) -> None:
    publish_versions(
        tmp_path,
        "VLLM",
        vllm_server.url,
        [1, 2, 3],
        lambda model, version: assert_serves(vllm_server.url, model, version),
    )


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_mode_with_a_request_in_flight(
    vllm_server: EngineServer, rig: Callable[..., Rig], mode: str
) -> None:
    old, new = trainer(11), trainer(12)
    link = rig(pause_mode=mode)
    link.run(link.sync(state(old), 11))
    body = {
        "model": "model",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    running = stream(f"{vllm_server.url}/v1/completions", body)
    running.wait_tokens(3)
    link.run(link.sync(state(new), 12))
    chunks = running.join()
    tokens = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids") or []]
    finish = [
        c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]
    ]
    old_tokens = reference_tokens(old, PROMPT, LONG)
    if mode == "abort":
        assert finish == ["abort"]
        assert 3 <= len(tokens) < LONG
        assert tokens == old_tokens[: len(tokens)]
    elif mode == "wait":
        # Drained: the whole request ran on the old weights before the update.
        assert finish == ["length"]
        assert tokens == old_tokens
    else:
        # Frozen, then preempted by /reset_prefix_cache: recomputed on the new weights.
        assert finish == ["length"]
        assert len(tokens) == LONG
        assert resumed_on_new_weights(tokens, old_tokens, new) >= 3
    assert_serves(vllm_server.url, new, 12)


@pytest.mark.parametrize("fault", ["unknown_name", "wrong_shape"])
def test_failed_update_is_repaired_and_the_engine_says_it_is_torn(
    vllm_server: EngineServer, rig: Callable[..., Rig], fault: str
) -> None:
    old, new = trainer(31), trainer(32)
    link = rig()
    link.run(link.sync(state(old), 31))
    weights = dict(state(new))
    if fault == "unknown_name":
        # Not a bias: vLLM's Llama loader skips a bias its model lacks without a word.
        weights = {"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 128), **weights}
    else:
        name = "model.layers.0.mlp.down_proj.weight"
        weights = {name: torch.zeros(128, 128), **{k: v for k, v in weights.items() if k != name}}

    async def round_() -> None:
        await link.adapter.begin_update(32)
        with pytest.raises(EngineError) as caught:
            await link.load(plan_buckets(weights))
        # Several workers on CPU: vLLM wraps the worker's message.
        assert caught.value.reason == "engine_failed", caught.value
        # The 500 closed the connection; the abort goes through on new ones.
        await link.adapter.abort_update(32, str(caught.value))

    link.run(round_())
    health = link.run(link.adapter.health())
    assert health.healthy
    assert health.torn  # a load reached vLLM: it cannot tell what stayed
    # The failing run was the first: nothing of it was loaded, the old weights serve.
    choice = completion(vllm_server.url, PROMPT, 8)["choices"][0]
    assert choice["token_ids"] == reference_tokens(old, PROMPT, 8)
    link.run(link.sync(state(new), 33))
    assert_serves(vllm_server.url, new, 33)


def test_every_recorded_exchange_matches_the_real_server(vllm_server: EngineServer) -> None:
    # The fakes answer as the recording says (tests/unit/engines/test_recordings.py); so
    # must the real server, or a fake would be testing the adapter against a fiction.
    assert replay(vllm_server.url, "vllm") == []


def test_engine_killed_mid_round_fails_the_round(
    vllm_server: EngineServer, rig: Callable[..., Rig]
) -> None:
    killed_mid_round(vllm_server, rig())
