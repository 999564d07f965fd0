"""What only SGLang does, on a real SGLang 0.5.23 server (CPU, torch_native attention):
its pause modes with a request in flight, the stale prefix cache in_place leaves, and
buckets it would drop or die on. The contract every engine keeps is `test_contract.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.engines_real.rig import (
    BUCKET_BYTES,
    PROMPT,
    Rig,
    post_empty,
    reference_tokens,
    state,
    stream,
    trainer,
)
from tests.engines_real.servers import EngineServer
from tests.engines_real.serving import assert_sglang_serves, generate, resumed_on_new_weights
from tests.support.engine_contract import plan_buckets
from weightsync.engines.base import EngineError
from weightsync.engines.sglang import SGLangAdapter, SGLangSettings

pytestmark = pytest.mark.parametrize("engine_server", ["sglang"], indirect=True)

LONG = 160  # tokens of a request kept in flight across a round (about 30 ms each)


@pytest.fixture
def rig(engine_server: EngineServer) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(**settings: Any) -> Rig:
        adapter = SGLangAdapter(SGLangSettings(base_url=engine_server.url, **settings))
        made.append(Rig.attach(adapter))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_pause_mode_with_a_request_in_flight(
    engine_server: EngineServer, rig: Callable[..., Rig], mode: str
) -> None:
    old, new = trainer(11), trainer(12)
    link = rig(pause_mode=mode)
    link.run(link.sync(state(old), 11))
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    running = stream(f"{engine_server.url}/generate", body)
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


def test_in_place_without_flush_serves_the_stale_prefix_cache(
    engine_server: EngineServer, rig: Callable[..., Rig]
) -> None:
    old, new = trainer(21), trainer(22)
    link = rig(pause_mode="in_place", flush_cache=False)
    link.run(link.sync(state(old), 21))
    prompt = list(range(10, 60))  # long enough for the radix cache to keep its prefix
    assert generate(engine_server.url, prompt, 4)["output_ids"] == reference_tokens(old, prompt, 4)
    link.run(link.sync(state(new), 22))
    # A *new* request after the round reuses the prompt's KV computed with the old weights.
    stale = generate(engine_server.url, prompt, 4)
    assert stale["meta_info"]["cached_tokens"] > 0
    assert stale["output_ids"] != reference_tokens(new, prompt, 4)
    post_empty(f"{engine_server.url}/flush_cache")
    assert generate(engine_server.url, prompt, 4)["output_ids"] == reference_tokens(new, prompt, 4)


@pytest.mark.parametrize("fault", ["unknown_name", "wrong_shape"])
def test_bad_bucket_fails_the_round_and_leaves_the_old_version_whole(
    engine_server: EngineServer, rig: Callable[..., Rig], fault: str
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
            await link.load(plan_buckets(weights, BUCKET_BYTES))
        assert caught.value.reason == "bad_bucket"
        await link.adapter.abort_update(32, str(caught.value))

    link.run(round_())
    health = link.run(link.adapter.health())
    assert health.healthy
    assert (health.version, health.torn) == (31, False)
    assert_sglang_serves(engine_server.url, state(old), 31)
