"""The SGLang and vLLM adapters' memory calls, request by request.

The answers are the servers' own, read from their source (vLLM 0.32
`entrypoints/serve/dev/sleep/api_router.py`, SGLang 0.5.23 `http_server.py`); the
recorded fakes have no memory routes yet, and sleep needs CUDA, so the real CPU servers
(`tests/engines_real`) cannot check these: a GPU run must.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from aiohttp import web

from tests.unit.engines.fakes.common import serve
from tests.unit.engines.fakes.vllm_server import FakeVLLM
from tests.unit.engines.harness import CASES, SLOT_BYTES, VLLM, EngineCase, Link, connected
from tests.unit.engines.support import cpu_slots, make_model, run, zeros_like_model
from weightsync.api.engines import MemoryTag
from weightsync.api.reasons import EngineErrorReason
from weightsync.engines.base import EngineError
from weightsync.engines.sglang import SGLangAdapter
from weightsync.engines.vllm import VLLMAdapter

KV = frozenset({MemoryTag.KV_CACHE})
BOTH = frozenset(MemoryTag)


@dataclass
class Seen:
    """Every request the server got: method, path, query (repeats kept), JSON body."""

    requests: list[tuple[str, str, list[tuple[str, str]], Any]] = field(default_factory=list)
    refuse: bool = False  # answer as a server started without sleep mode / memory saver

    def app(self, answers: dict[str, Any]) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            body = await request.json() if request.can_read_body else None
            self.requests.append((request.method, request.path, list(request.query.items()), body))
            if self.refuse:
                return web.json_response({"error": {"message": "sleep mode is off"}}, status=400)
            return web.json_response(answers.get(request.path))

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app


def _vllm_answers() -> dict[str, Any]:
    return {
        "/sleep": {"status": "sleeping", "level": 1},
        "/wake_up": {"status": "sleeping", "tags": ["weights"]},
        "/weight_info": {"weight_version": "ws:1"},
        "/health": None,
    }


@pytest.mark.parametrize(("tags", "level"), [(KV, "1"), (BOTH, "2")])
def test_vllm_sleeps_at_the_level_that_frees_the_tags_and_wakes_tag_by_tag(
    tags: frozenset[MemoryTag], level: str
) -> None:
    seen = Seen()

    async def scenario() -> frozenset[MemoryTag]:
        async with serve(seen.app(_vllm_answers())) as url:
            adapter = VLLMAdapter(url)
            try:
                freed = await adapter.release_memory(tags)
                assert "sleeping" in (await adapter.health()).detail
                await adapter.resume_memory(freed)
                assert "sleeping" not in (await adapter.health()).detail
                return freed
            finally:
                await adapter.close()

    freed = run(scenario())
    assert freed == BOTH  # level 1 moves the weights to host memory: they must be woken
    calls = [(m, p, q) for m, p, q, _ in seen.requests if p not in {"/weight_info", "/health"}]
    assert calls == [
        ("POST", "/sleep", [("level", level), ("mode", "abort")]),
        ("POST", "/wake_up", [("tags", "weights")]),
        ("POST", "/wake_up", [("tags", "kv_cache")]),
    ]


def test_sglang_releases_and_resumes_with_its_tags_weights_first() -> None:
    seen = Seen()

    async def scenario() -> frozenset[MemoryTag]:
        async with serve(seen.app({})) as url:
            adapter = SGLangAdapter(url)
            try:
                freed = await adapter.release_memory(BOTH)
                await adapter.resume_memory(freed)
                return freed
            finally:
                await adapter.close()

    assert run(scenario()) == BOTH
    assert [(m, p, b) for m, p, _, b in seen.requests] == [
        ("POST", "/pause_generation", {"mode": "abort"}),  # it releases only an idle server
        ("POST", "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
        ("POST", "/resume_memory_occupation", {"tags": ["weights"]}),
        ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
        ("POST", "/continue_generation", {}),  # once fully awake
    ]


MEMORY_ROUTES = ("/sleep", "/wake_up", "/release_memory_occupation", "/resume_memory_occupation")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_round_while_asleep_never_restarts_generation_before_the_kv_cache_is_back(
    case: EngineCase,
) -> None:
    """Between the release and the last wake the engine has no KV cache: a round there
    must not pause or resume generation (the release paused it; the last wake resumes)."""
    source = make_model(seed=5)
    fake = case.make_fake(zeros_like_model(source))
    app = fake.app()

    async def memory_route(request: web.Request) -> web.Response:
        return web.json_response(None)

    for path in MEMORY_ROUTES:
        app.router.add_post(path, memory_route)

    async def scenario() -> None:
        async with serve(app) as url:
            adapter = case.make_adapter(url)
            slots = cpu_slots(2, SLOT_BYTES)
            await adapter.attach_buffers(slots)
            link = Link(adapter, slots, url)
            try:
                await adapter.release_memory(BOTH)
                await adapter.resume_memory(frozenset({MemoryTag.WEIGHTS}))
                await link.sync(source, 1)
                await adapter.resume_memory(KV)
            finally:
                await adapter.close()

    run(scenario())
    paths = fake.controls.paths()
    first = min(i for i, p in enumerate(paths) if p in MEMORY_ROUTES)
    last = max(i for i, p in enumerate(paths) if p in MEMORY_ROUTES)
    asleep = paths[first:last]
    assert case.load_path in asleep  # the round ran in between
    assert case.resume_path not in asleep
    assert not {"/pause", "/pause_generation"} & set(asleep)
    for name, tensor in source.items():
        assert torch.equal(fake.model[name], tensor), name


@pytest.mark.parametrize("adapter_class", [VLLMAdapter, SGLangAdapter])
def test_a_refusal_is_an_engine_error_with_the_servers_message(
    adapter_class: type[VLLMAdapter] | type[SGLangAdapter],
) -> None:
    seen = Seen(refuse=True)

    async def scenario() -> None:
        async with serve(seen.app({})) as url:
            adapter = adapter_class(url)
            try:
                with pytest.raises(EngineError, match="sleep mode is off") as caught:
                    await adapter.release_memory(KV)
                assert caught.value.reason == EngineErrorReason.REJECTED
                assert "sleeping" not in (await adapter.health()).detail
            finally:
                await adapter.close()

    run(scenario())


def test_release_inside_a_round_is_refused_before_anything_is_sent() -> None:
    fake = FakeVLLM(model=zeros_like_model(make_model()))

    async def scenario() -> None:
        async with connected(VLLM, fake) as link:
            await link.adapter.begin_update(1)
            with pytest.raises(EngineError) as caught:
                await link.adapter.release_memory(KV)
            assert caught.value.reason == EngineErrorReason.SEQUENCE
            await link.adapter.abort_update(1, "test over")

    run(scenario())
    assert "/sleep" not in fake.controls.paths()


@pytest.mark.parametrize("asleep", [True, False])
def test_vllm_says_whether_it_sleeps_and_the_adapter_adopts_it(asleep: bool) -> None:
    """An agent restarted while vLLM sleeps: `/is_sleeping` (a bool, vLLM 0.32
    `serve/dev/sleep/api_router.py`) reads as both tags, which the next round wakes."""
    seen = Seen()

    async def scenario() -> frozenset[MemoryTag] | None:
        answers = {**_vllm_answers(), "/is_sleeping": {"is_sleeping": asleep}}
        async with serve(seen.app(answers)) as url:
            adapter = VLLMAdapter(url)  # a fresh adapter: it never released anything
            try:
                released = await adapter.released_memory()
                assert ("sleeping" in (await adapter.health()).detail) is asleep
                await adapter.resume_memory(released or frozenset())
                return released
            finally:
                await adapter.close()

    assert run(scenario()) == (BOTH if asleep else frozenset())
    calls = [(m, p, q) for m, p, q, _ in seen.requests if p not in {"/weight_info", "/health"}]
    wakes = [
        ("POST", "/wake_up", [("tags", "weights")]),
        ("POST", "/wake_up", [("tags", "kv_cache")]),
    ]
    assert calls == [("GET", "/is_sleeping", []), *(wakes if asleep else [])]


def test_sglang_does_not_say_so_nothing_is_asked_or_adopted() -> None:
    seen = Seen()

    async def scenario() -> frozenset[MemoryTag] | None:
        async with serve(seen.app({})) as url:
            adapter = SGLangAdapter(url)
            try:
                return await adapter.released_memory()
            finally:
                await adapter.close()

    assert run(scenario()) is None  # its offload_tags are in no route of SGLang 0.5.23
    assert seen.requests == []
