"""The engine contract: what every `EngineAdapter` promises, written once.

`EngineContract`'s tests run against every engine: the reference engine, and SGLang and
vLLM as recorded fakes (`tests/unit/engines/test_contract.py`) and as real CPU servers
(`tests/engines_real/test_contract.py`). Each tier subclasses it with an `engine` fixture,
an `EngineUnderTest`: an adapter built the one way agents build theirs
(`for_engine(url)`), attached to two bucket slots, plus what the test may ask the engine
itself (what it serves, whether it is paused), never through the adapter under test.

Engines differ in two ways the contract names: an engine that *stages* (the reference
engine) keeps serving its old version when a round is aborted after a load; one that
loads in place (SGLang, vLLM) reports itself torn until a full round (`engines.base`),
and either generates meanwhile (SGLang) or *holds* its requests, paused, until that round
(vLLM: `RoundAdapter.resumes_torn`).
What each engine does beyond this (routes, payloads, pause modes) is tested per engine.
"""

from __future__ import annotations

import abc
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch

from tests.support.ports import free_port
from weightsync.api.engines import MemoryTag
from weightsync.api.reasons import EngineErrorReason
from weightsync.api.v1alpha1 import Engine
from weightsync.engines import adapter_class
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.layout import TensorSlice

T = TypeVar("T")
Weights = dict[str, torch.Tensor]
# The contract's test that leaves its engine dead: a tier sharing one engine runs it last.
KILLS_ENGINE = "test_an_engine_killed_mid_round_fails_the_round"


def plan_buckets(weights: Weights, capacity: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Name-ordered buckets of at most `capacity` bytes."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, tensor in weights.items():
        if used + tensor.nbytes > capacity and out[-1]:
            out.append([])
            used = 0
        out[-1].append((name, tensor))
        used += tensor.nbytes
    return out


def pack(slot: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> list[TensorSlice]:
    """Write `named` into `slot` at 64-byte aligned offsets, as the agent's layout does."""
    slices: list[TensorSlice] = []
    offset = 0
    for name, tensor in named:
        offset = -(-offset // 64) * 64
        raw = tensor.contiguous().view(-1).view(torch.uint8)
        slot[offset : offset + raw.numel()].copy_(raw)
        dtype = str(tensor.dtype).removeprefix("torch.")
        slices.append(TensorSlice(name, dtype, tuple(tensor.shape), offset, raw.numel()))
        offset += raw.numel()
    return slices


class EngineUnderTest(abc.ABC):
    """One engine and an attached adapter, driven on one event loop."""

    engine: Engine
    stages: bool  # an abort after a load keeps the old version serving (else: torn)
    holds_torn = False  # torn, it stays paused until a full round (else: it generates)
    sequence_reason: str  # the reason a call out of order is refused with
    # Frees and brings back its memory between Colocated rounds (`release_memory`) where
    # the tier can run it: its tier runs `MemoryContract` on it too.
    releases_memory: bool = False
    url: str
    adapter: EngineAdapter
    slots: list[torch.Tensor]

    def __str__(self) -> str:
        return self.engine.value

    # -- what each engine provides ---------------------------------------------------------

    @abc.abstractmethod
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop the adapter's connections belong to."""

    @abc.abstractmethod
    def new_slots(self) -> list[torch.Tensor]:
        """Two fresh bucket slots, as an agent's."""

    @abc.abstractmethod
    def weights(self, seed: int) -> Weights:
        """A full set of the engine's model's tensors, seeded."""

    @abc.abstractmethod
    def assert_serves(self, weights: Weights, version: int) -> None:
        """Assert, asking the engine itself, that it serves `weights` as `version`."""

    @abc.abstractmethod
    def assert_at_rest(self) -> None:
        """Assert, asking the engine itself, that no update is open and it generates."""

    def assert_holds_requests(self) -> None:
        """Assert, asking the engine itself, that no update is open and it is paused."""
        raise NotImplementedError(f"{self} does not hold requests while torn")

    def resident_bytes(self) -> int:
        """What the engine holds in memory now, asking the engine itself."""
        raise NotImplementedError(f"{self} cannot measure its memory")

    def assert_refuses_inference(self) -> None:
        """Assert, asking the engine itself, that it refuses to generate (it sleeps)."""
        raise NotImplementedError(f"{self} cannot be asked to generate")

    @abc.abstractmethod
    def kill(self) -> None:
        """The engine process dies (every connection to it fails from now on)."""

    # -- what the tests do with it -----------------------------------------------------------

    def attach(self) -> None:
        self.adapter = adapter_class(self.engine).for_engine(self.url)
        self.slots = self.new_slots()
        self.run(self.adapter.attach_buffers(self.slots))

    def restart_agent(self) -> None:
        """The agent dies without aborting its round; a new one attaches new slots."""
        self.run(self.adapter.close())
        self.attach()

    @property
    def slot_bytes(self) -> int:
        return self.slots[0].numel()

    async def load(self, weights: Weights, *, limit: int | None = None) -> int:
        """Load `weights` bucket by bucket into alternating slots; return the bucket count."""
        plan = plan_buckets(weights, self.slot_bytes // 2)[:limit]  # room for alignment
        for index, bucket in enumerate(plan):
            slot = index % 2
            await self.adapter.load_bucket(slot, pack(self.slots[slot], bucket))
        return len(plan)

    async def sync(self, weights: Weights, version: int) -> None:
        """A whole round."""
        await self.adapter.begin_update(version)
        await self.load(weights)
        await self.adapter.finish_update(version)


class MemoryContract:
    """Releasing and waking an engine's memory between Colocated rounds; a tier subclasses
    it for the engines that can (`releases_memory`: the recorded fakes have no recordings
    of those routes, and vLLM's and SGLang's CPU builds cannot sleep)."""

    def test_released_kv_cache_is_freed_and_woken_after_the_next_round(
        self, engine: EngineUnderTest
    ) -> None:
        first, second = engine.weights(1), engine.weights(2)
        engine.run(engine.sync(first, 1))
        awake = engine.resident_bytes()
        freed = engine.run(engine.adapter.release_memory(frozenset({MemoryTag.KV_CACHE})))
        assert MemoryTag.KV_CACHE in freed
        assert engine.resident_bytes() < awake
        # What a restarted agent asks before it trusts its own idea of the engine's state.
        assert engine.run(engine.adapter.released_memory()) == freed
        engine.assert_refuses_inference()
        assert "sleeping" in engine.run(engine.adapter.health()).detail
        engine.run(engine.adapter.resume_memory(freed & {MemoryTag.WEIGHTS}))
        engine.run(engine.sync(second, 2))
        engine.run(engine.adapter.resume_memory(freed - {MemoryTag.WEIGHTS}))
        assert engine.resident_bytes() == awake
        engine.assert_serves(second, 2)
        engine.assert_at_rest()

    def test_released_weights_leave_memory_and_come_back_with_a_round(
        self, engine: EngineUnderTest
    ) -> None:
        first, second = engine.weights(1), engine.weights(2)
        engine.run(engine.sync(first, 1))
        awake = engine.resident_bytes()
        kv_only = engine.run(engine.adapter.release_memory(frozenset({MemoryTag.KV_CACHE})))
        engine.run(engine.adapter.resume_memory(kv_only))
        everything = frozenset(MemoryTag)
        assert engine.run(engine.adapter.release_memory(everything)) == everything
        model_bytes = sum(tensor.nbytes for tensor in first.values())
        asleep = engine.resident_bytes()
        assert asleep <= awake - model_bytes  # at least one copy of the model freed
        engine.run(engine.adapter.resume_memory(frozenset({MemoryTag.WEIGHTS})))
        assert engine.resident_bytes() >= asleep + model_bytes  # allocated again
        engine.assert_refuses_inference()  # memory is back, the bytes come with the round
        engine.run(engine.sync(second, 2))
        engine.run(engine.adapter.resume_memory(frozenset({MemoryTag.KV_CACHE})))
        assert engine.resident_bytes() == awake
        engine.assert_serves(second, 2)
        engine.assert_at_rest()

    def test_a_failed_round_after_released_weights_never_serves_them_stale(
        self, engine: EngineUnderTest
    ) -> None:
        first = engine.weights(1)
        engine.run(engine.sync(first, 1))
        engine.run(engine.adapter.release_memory(frozenset(MemoryTag)))
        engine.run(engine.adapter.resume_memory(frozenset({MemoryTag.WEIGHTS})))
        engine.run(engine.adapter.begin_update(2))
        engine.run(engine.load(engine.weights(2), limit=1))
        engine.run(engine.adapter.abort_update(2, "broadcast failed"))
        engine.run(engine.adapter.resume_memory(frozenset({MemoryTag.KV_CACHE})))
        health = engine.run(engine.adapter.health())
        assert "sleeping" in health.detail
        engine.assert_refuses_inference()
        engine.run(engine.sync(first, 3))
        engine.assert_serves(first, 3)
        engine.assert_at_rest()

    def test_release_during_an_update_is_refused(self, engine: EngineUnderTest) -> None:
        engine.run(engine.sync(engine.weights(1), 1))
        engine.run(engine.adapter.begin_update(2))
        with pytest.raises(EngineError) as caught:
            engine.run(engine.adapter.release_memory(frozenset(MemoryTag)))
        assert caught.value.reason == EngineErrorReason.SEQUENCE
        engine.run(engine.adapter.abort_update(2, "test over"))
        engine.assert_serves(engine.weights(1), 1)


class EngineContract:
    """Every engine's contract; a tier subclasses it as `Test...` with an `engine` fixture."""

    def test_a_round_loads_every_tensor_and_serves_its_version(
        self, engine: EngineUnderTest
    ) -> None:
        weights = engine.weights(1)
        engine.run(engine.adapter.begin_update(7))
        assert engine.run(engine.load(weights)) >= 2
        engine.run(engine.adapter.finish_update(7))
        health = engine.run(engine.adapter.health())
        assert (health.healthy, health.version, health.torn) == (True, 7, False)
        engine.assert_serves(weights, 7)
        engine.assert_at_rest()

    def test_a_second_round_replaces_every_tensor(self, engine: EngineUnderTest) -> None:
        first, second = engine.weights(1), engine.weights(2)
        engine.run(engine.sync(first, 1))
        engine.assert_serves(first, 1)
        engine.run(engine.sync(second, 2))
        engine.assert_serves(second, 2)

    def test_an_awake_engine_says_it_released_nothing(self, engine: EngineUnderTest) -> None:
        """What an agent asks at attach (`released_memory`), so that one restarted while its
        engine sleeps wakes it in order: an engine that released nothing says so, or that
        it cannot tell (None), and never names a tag it still holds."""
        engine.run(engine.sync(engine.weights(1), 1))
        assert engine.run(engine.adapter.released_memory()) in (frozenset(), None)

    def test_calls_out_of_order_are_refused_and_change_nothing(
        self, engine: EngineUnderTest
    ) -> None:
        weights = engine.weights(3)
        engine.run(engine.sync(weights, 3))
        bucket = pack(engine.slots[0], plan_buckets(weights, engine.slot_bytes // 2)[0])
        with pytest.raises(EngineError) as outside:
            engine.run(engine.adapter.load_bucket(0, bucket))
        assert outside.value.reason == engine.sequence_reason
        engine.run(engine.adapter.begin_update(4))
        with pytest.raises(EngineError) as other:
            engine.run(engine.adapter.finish_update(5))
        assert other.value.reason == engine.sequence_reason
        engine.run(engine.adapter.abort_update(4, "test over"))
        health = engine.run(engine.adapter.health())
        assert (health.healthy, health.version, health.torn) == (True, 3, False)
        engine.assert_serves(weights, 3)
        engine.assert_at_rest()

    def test_a_bucket_beyond_its_slot_is_refused_and_the_old_version_serves(
        self, engine: EngineUnderTest
    ) -> None:
        weights = engine.weights(4)
        engine.run(engine.sync(weights, 4))
        name, tensor = next(iter(weights.items()))
        dtype = str(tensor.dtype).removeprefix("torch.")
        beyond = TensorSlice(name, dtype, tuple(tensor.shape), engine.slot_bytes, tensor.nbytes)
        engine.run(engine.adapter.begin_update(5))
        with pytest.raises(EngineError) as caught:
            engine.run(engine.adapter.load_bucket(0, [beyond]))
        assert caught.value.reason == "bad_bucket"
        with pytest.raises(EngineError):  # a slot that was never attached
            engine.run(engine.adapter.load_bucket(len(engine.slots) + 3, [beyond]))
        engine.run(engine.adapter.abort_update(5, "bad bucket"))
        health = engine.run(engine.adapter.health())
        assert (health.healthy, health.version, health.torn) == (True, 4, False)
        engine.assert_serves(weights, 4)

    def test_an_unreachable_engine_is_an_engine_error(self, engine: EngineUnderTest) -> None:
        nobody = adapter_class(engine.engine).for_engine(f"http://127.0.0.1:{free_port()}")

        async def scenario() -> None:
            try:
                with pytest.raises(EngineError) as caught:
                    await nobody.begin_update(1)
                assert caught.value.reason == "unreachable"
                health = await nobody.health()
                assert (health.healthy, health.version) == (False, None)
            finally:
                await nobody.close()

        engine.run(scenario())

    def test_abort_before_any_load_keeps_the_served_version(self, engine: EngineUnderTest) -> None:
        weights = engine.weights(5)
        engine.run(engine.sync(weights, 5))
        engine.run(engine.adapter.begin_update(6))
        engine.run(engine.adapter.abort_update(6, "trainer gave up"))
        health = engine.run(engine.adapter.health())
        assert (health.healthy, health.version, health.torn) == (True, 5, False)
        engine.assert_serves(weights, 5)
        engine.assert_at_rest()

    def test_abort_after_a_load_keeps_the_old_version_or_says_torn_until_a_full_round(
        self, engine: EngineUnderTest
    ) -> None:
        first, second, third = engine.weights(1), engine.weights(2), engine.weights(3)
        engine.run(engine.sync(first, 1))
        engine.run(engine.adapter.begin_update(2))
        engine.run(engine.load(second, limit=1))
        engine.run(engine.adapter.abort_update(2, "broadcast failed"))
        if engine.holds_torn:
            engine.assert_holds_requests()
        else:
            engine.assert_at_rest()
        health = engine.run(engine.adapter.health())
        assert health.healthy
        if engine.stages:
            assert (health.version, health.torn) == (1, False)
            engine.assert_serves(first, 1)
        else:
            assert (health.version, health.torn) == (None, True)
        engine.run(engine.sync(third, 3))
        repaired = engine.run(engine.adapter.health())
        assert (repaired.version, repaired.torn) == (3, False)
        engine.assert_serves(third, 3)
        engine.assert_at_rest()

    def test_a_restarted_agent_finds_what_the_old_one_left_and_recovers(
        self, engine: EngineUnderTest
    ) -> None:
        first, second = engine.weights(1), engine.weights(2)
        engine.run(engine.sync(first, 1))
        engine.run(engine.adapter.begin_update(2))
        engine.run(engine.load(second, limit=1))
        engine.restart_agent()  # mid-round: the engine may still be paused, its session open
        seen = engine.run(engine.adapter.health())
        if engine.stages:
            assert (seen.version, seen.torn) == (1, False)
        else:
            assert seen.torn
        engine.run(engine.sync(second, 2))
        health = engine.run(engine.adapter.health())
        assert (health.healthy, health.version, health.torn) == (True, 2, False)
        engine.assert_serves(second, 2)
        engine.assert_at_rest()

    def test_health_mid_round_reports_the_served_version(self, engine: EngineUnderTest) -> None:
        weights = engine.weights(3)
        engine.run(engine.sync(weights, 3))
        engine.run(engine.adapter.begin_update(4))
        engine.run(engine.load(engine.weights(4), limit=1))
        health = engine.run(engine.adapter.health())
        engine.run(engine.adapter.abort_update(4, "test over"))
        assert (health.healthy, health.version, health.torn) == (True, 3, False)

    def test_an_engine_killed_mid_round_fails_the_round(self, engine: EngineUnderTest) -> None:
        # KILLS_ENGINE: the engine stays dead.
        old, new = engine.weights(41), engine.weights(42)
        engine.run(engine.sync(old, 41))
        buckets = plan_buckets(new, engine.slot_bytes // 2)
        assert len(buckets) >= 2
        engine.run(engine.adapter.begin_update(42))
        engine.run(engine.adapter.load_bucket(0, pack(engine.slots[0], buckets[0])))
        engine.kill()
        with pytest.raises(EngineError) as caught:
            engine.run(engine.adapter.load_bucket(1, pack(engine.slots[1], buckets[1])))
        assert caught.value.reason == "unreachable"
        with pytest.raises(EngineError):
            engine.run(engine.adapter.abort_update(42, "engine gone"))
        health = engine.run(engine.adapter.health())
        assert (health.healthy, health.version) == (False, None)
