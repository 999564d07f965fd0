"""weightsync against a real SGLang 0.5.23 server (CPU engine, torch_native attention).

One server for the module; every test leaves it serving a whole version, except the
last, which kills it.
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
    killed_mid_round,
    plan_buckets,
    post_empty,
    post_json,
    reference_tokens,
    state,
    stream,
    trainer,
)
from tests.engines_real.servers import EngineServer
from weightsync.engines.base import EngineError
from weightsync.engines.sglang import SGLangAdapter, SGLangSettings
from weightsync.reference.model import LlamaForCausalLM

LONG = 160  # tokens of a request kept in flight across a round (about 30 ms each)


def generate(url: str, prompt: list[int], count: int) -> dict[str, object]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": count, "temperature": 0, "ignore_eos": True},
    }
    reply: dict[str, object] = post_json(f"{url}/generate", body)
    return reply


def read_back(url: str, name: str, like: torch.Tensor) -> torch.Tensor:
    values = post_json(f"{url}/get_weights_by_name", {"name": name, "truncate_size": like.shape[0]})
    return torch.tensor(values, dtype=torch.float32).reshape(like.shape)


def assert_serves(url: str, model: LlamaForCausalLM, version: int) -> None:
    """Every tensor reads back bit-exact; greedy output equals the reference model's."""
    for name, tensor in state(model).items():
        assert torch.equal(read_back(url, name, tensor), tensor), name
    reply = generate(url, PROMPT, 8)
    assert reply["output_ids"] == reference_tokens(model, PROMPT, 8)
    meta = reply["meta_info"]
    assert isinstance(meta, dict)
    assert meta["weight_version"] == str(version)


@pytest.fixture
def rig(sglang_server: EngineServer) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(**settings: Any) -> Rig:
        adapter = SGLangAdapter(SGLangSettings(base_url=sglang_server.url, **settings))
        made.append(Rig.attach(adapter))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_agent_syncs_three_versions_bit_exact(sglang_server: EngineServer, tmp_path: Path) -> None:
    publish_versions(
        tmp_path,
        "SGLang",
        sglang_server.url,
        [1, 2, 3],
        lambda model, version: assert_serves(sglang_server.url, model, version),
    )


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_pause_mode_with_a_request_in_flight(
    sglang_server: EngineServer, rig: Callable[..., Rig], mode: str
) -> None:
    old, new = trainer(11), trainer(12)
    link = rig(pause_mode=mode)
    link.run(link.sync(state(old), 11))
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    running = stream(f"{sglang_server.url}/generate", body)
    running.wait_tokens(3)
    link.run(link.sync(state(new), 12))
    chunks = running.join()
    final = chunks[-1]
    tokens = final["output_ids"]
    old_tokens = reference_tokens(old, PROMPT, LONG)
    if mode == "abort":
        # Aborted: what it got came from the old weights; the client retries.
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert 3 <= len(tokens) < LONG
        assert tokens == old_tokens[: len(tokens)]
        return
    # Retracted: back to the queue, resumed on the new weights with its KV recomputed.
    assert len(tokens) == LONG
    assert final["meta_info"]["num_retractions"] >= 1
    versions = {entry["version"] for entry in final["meta_info"]["weight_versions"]}
    assert versions == {"11", "12"}
    assert resumed_on_new_weights(tokens, old_tokens, new) >= 3


def resumed_on_new_weights(tokens: list[int], old_tokens: list[int], new: LlamaForCausalLM) -> int:
    """Where `tokens` switched from the old weights' greedy output to the new weights'
    continuation of what came before: the number of old tokens, asserted to exist."""
    split = next(i for i, (a, b) in enumerate(zip(tokens, old_tokens, strict=True)) if a != b)
    # The switch is at or before the first token that differs (tokens may agree by chance).
    for k in range(split, 0, -1):
        if tokens[k:] == reference_tokens(new, PROMPT + tokens[:k], len(tokens) - k):
            return k
    raise AssertionError(f"no point where the new weights took over: {tokens}")


def test_in_place_without_flush_serves_the_stale_prefix_cache(
    sglang_server: EngineServer, rig: Callable[..., Rig]
) -> None:
    old, new = trainer(21), trainer(22)
    link = rig(pause_mode="in_place", flush_cache=False)
    link.run(link.sync(state(old), 21))
    prompt = list(range(10, 60))  # long enough for the radix cache to keep its prefix
    assert generate(sglang_server.url, prompt, 4)["output_ids"] == reference_tokens(old, prompt, 4)
    link.run(link.sync(state(new), 22))
    # A *new* request after the round reuses the prompt's KV computed with the old weights.
    stale = generate(sglang_server.url, prompt, 4)
    assert stale["meta_info"]["cached_tokens"] > 0
    assert stale["output_ids"] != reference_tokens(new, prompt, 4)
    post_empty(f"{sglang_server.url}/flush_cache")
    assert generate(sglang_server.url, prompt, 4)["output_ids"] == reference_tokens(new, prompt, 4)


@pytest.mark.parametrize("fault", ["unknown_name", "wrong_shape"])
def test_bad_bucket_fails_the_round_and_leaves_the_old_version_whole(
    sglang_server: EngineServer, rig: Callable[..., Rig], fault: str
) -> None:
    old, new = trainer(31), trainer(32)
    link = rig()
    link.run(link.sync(state(old), 31))
    weights = dict(state(new))
    if fault == "unknown_name":
        weights = {"model.layers.0.self_attn.q_proj.bias": torch.zeros(128), **weights}
    else:
        name = "model.layers.0.mlp.down_proj.weight"
        weights = {name: torch.zeros(128, 128), **{k: v for k, v in weights.items() if k != name}}

    async def round_() -> None:
        await link.adapter.begin_update(32)
        with pytest.raises(EngineError) as caught:
            await link.load(plan_buckets(weights))
        assert caught.value.reason == "bad_bucket"
        await link.adapter.abort_update(32, str(caught.value))

    link.run(round_())
    health = link.run(link.adapter.health())
    assert health.healthy
    assert (health.version, health.torn) == (31, False)
    assert_serves(sglang_server.url, old, 31)


def test_every_recorded_exchange_matches_the_real_server(sglang_server: EngineServer) -> None:
    # The fakes answer as the recording says (tests/unit/engines/test_recordings.py); so
    # must the real server, or a fake would be testing the adapter against a fiction.
    assert replay(sglang_server.url, "sglang") == []


def test_engine_killed_mid_round_fails_the_round(
    sglang_server: EngineServer, rig: Callable[..., Rig]
) -> None:
    killed_mid_round(sglang_server, rig())
