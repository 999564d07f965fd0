"""What only vLLM does, on a real vLLM 0.32.0 server (the CPU build, weights over
/dev/shm through the "weightsync_shm" backend): its pause modes with a request in flight,
and a failed load repaired, the torn engine holding requests until the next round.
The contract every engine keeps is `test_contract.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

import pytest
import torch

from tests.engines_real.rig import (
    BUCKET_BYTES,
    PROMPT,
    Rig,
    reference_tokens,
    state,
    stream,
    trainer,
)
from tests.engines_real.servers import EngineServer
from tests.engines_real.serving import assert_vllm_serves, completion, resumed_on_new_weights
from tests.support.engine_contract import plan_buckets
from weightsync.engines.base import EngineError
from weightsync.engines.vllm import SHM_BACKEND, VLLMAdapter, VLLMSettings

pytestmark = pytest.mark.parametrize("engine_server", ["vllm"], indirect=True)

LONG = 160


@pytest.fixture
def rig(engine_server: EngineServer) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(**settings: Any) -> Rig:
        adapter = VLLMAdapter(VLLMSettings(base_url=engine_server.url, **settings))
        made.append(Rig.attach(adapter))
        assert adapter.backend == SHM_BACKEND
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_mode_with_a_request_in_flight(
    engine_server: EngineServer, rig: Callable[..., Rig], mode: str
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
    running = stream(f"{engine_server.url}/v1/completions", body)
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
    assert_vllm_serves(engine_server.url, state(new), 12)


@pytest.mark.parametrize("fault", ["unknown_name", "wrong_shape"])
def test_failed_update_is_repaired_and_the_engine_says_it_is_torn(
    engine_server: EngineServer, rig: Callable[..., Rig], fault: str
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
            await link.load(plan_buckets(weights, BUCKET_BYTES))
        # Several workers on CPU: vLLM wraps the worker's message.
        assert caught.value.reason == "engine_failed", caught.value
        # The 500 closed the connection; the abort goes through on new ones.
        await link.adapter.abort_update(32, str(caught.value))

    link.run(round_())
    health = link.run(link.adapter.health())
    assert health.healthy
    assert health.torn  # a load reached vLLM: it cannot tell what stayed
    # Torn, it stays paused: a request waits, never generating on the torn model, until
    # the next round's pause (abort mode) ends it for the client to retry.
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(completion, engine_server.url, PROMPT, 8)
        with pytest.raises(FuturesTimeout):
            waiting.result(timeout=3)
        link.run(link.sync(state(new), 33))
        ended = waiting.result(timeout=60)["choices"][0]
    assert (ended["token_ids"], ended["finish_reason"]) == ([], "abort")
    assert_vllm_serves(engine_server.url, state(new), 33)
