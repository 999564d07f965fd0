"""The scale harness's load generator answers as the agents do (the parts the operator reads)."""

from __future__ import annotations

import asyncio
import time

from tests.scale.loadgen import LoadGenerator, PlannedGeneration
from weightsync.api.control import GenerationState

F, W, A, R = (
    GenerationState.FORMING,
    GenerationState.WARM,
    GenerationState.ACTIVE,
    GenerationState.RETIRED,
)


def states(gen: LoadGenerator, pod: str) -> dict[int, GenerationState]:
    return {g.generation: g.state for g in gen.status(gen.stand_ins[pod]).generations}


def test_a_warm_generation_waits_beside_the_active_one_until_a_round_switches() -> None:
    """As on the agents: a newer generation warming does not retire the one rounds run
    in; the next round (in the source's newest warm one) does, on every member."""
    gen = LoadGenerator(warm_seconds=0.0, recover_seconds=0.0)
    gen.source = "trainer-0"
    past, future = time.monotonic() - 1, time.monotonic() + 60
    for pod in ("trainer-0", "engine-a"):
        gen.stand_in(pod).generations = {
            1: PlannedGeneration(1, 0, 2, past),
            2: PlannedGeneration(2, 0, 2, past),
        }
    gen.publish(1, sinks=True)  # a round: in generation 2, the newest warm
    assert states(gen, "engine-a") == {1: R, 2: A}
    gen.stand_ins["engine-a"].generations[3] = PlannedGeneration(3, 1, 3, past)
    gen.stand_ins["trainer-0"].generations[3] = PlannedGeneration(3, 0, 3, future)
    assert states(gen, "engine-a") == {1: R, 2: A, 3: W}  # warm here, still active: 2
    assert states(gen, "trainer-0") == {1: R, 2: A, 3: F}
    status = gen.status(gen.stand_ins["engine-a"])
    assert (status.generation, status.warm) == (2, True)
    gen.publish(2, sinks=True)  # the source's newest warm is still 2: no switch
    assert states(gen, "engine-a") == {1: R, 2: A, 3: W}


def test_an_address_answers_for_the_pod_that_holds_it_now() -> None:
    """KWOK re-addresses pods under load and hands freed addresses to others: each
    request is answered by the stand-in of the pod the harness last saw at it."""

    async def scenario() -> None:
        gen = LoadGenerator(warm_seconds=0.0, recover_seconds=0.0)
        await gen.address({"127.0.0.5": "engine-a"})
        first = await gen.at("127.0.0.5")
        assert first is not None
        assert first.pod == "engine-a"
        first.engine_version = 3
        await gen.address({"127.0.0.9": "engine-a"})  # moved: the same agent answers there
        await gen.address({"127.0.0.5": "engine-b"})  # the old address given to another pod
        assert await gen.at("127.0.0.9") is first
        other = await gen.at("127.0.0.5")
        assert other is not None
        assert (other.pod, other.engine_version) == ("engine-b", None)
        # An address announced while a request waits for it is answered.
        waiting = asyncio.create_task(gen.at("127.0.0.7"))
        await asyncio.sleep(0.01)
        await gen.address({"127.0.0.7": "engine-c"})
        late = await waiting
        assert late is not None
        assert late.pod == "engine-c"

    asyncio.run(scenario())
