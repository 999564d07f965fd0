"""The scale harness's load generator answers as the agents do (the parts the operator reads)."""

from __future__ import annotations

import time

from tests.scale.loadgen import LoadGenerator, PlannedGeneration
from weightsync.api.control import GenerationState

F, W, A, R = (
    GenerationState.FORMING,
    GenerationState.WARM,
    GenerationState.ACTIVE,
    GenerationState.RETIRED,
)


def states(gen: LoadGenerator, ip: str) -> dict[int, GenerationState]:
    return {g.generation: g.state for g in gen.status(gen.stand_ins[ip]).generations}


def test_a_warm_generation_waits_beside_the_active_one_until_a_round_switches() -> None:
    """As on the agents: a newer generation warming does not retire the one rounds run
    in; the next round (in the source's newest warm one) does, on every member."""
    gen = LoadGenerator(warm_seconds=0.0, recover_seconds=0.0)
    gen.source_ip = "127.0.0.1"
    past, future = time.monotonic() - 1, time.monotonic() + 60
    for ip in ("127.0.0.1", "127.0.0.2"):
        gen.stand_in(ip).generations = {
            1: PlannedGeneration(1, 0, 2, past),
            2: PlannedGeneration(2, 0, 2, past),
        }
    gen.publish(1, sinks=True)  # a round: in generation 2, the newest warm
    assert states(gen, "127.0.0.2") == {1: R, 2: A}
    gen.stand_ins["127.0.0.2"].generations[3] = PlannedGeneration(3, 1, 3, past)
    gen.stand_ins["127.0.0.1"].generations[3] = PlannedGeneration(3, 0, 3, future)
    assert states(gen, "127.0.0.2") == {1: R, 2: A, 3: W}  # warm here, still active: 2
    assert states(gen, "127.0.0.1") == {1: R, 2: A, 3: F}
    status = gen.status(gen.stand_ins["127.0.0.2"])
    assert (status.generation, status.warm) == (2, True)
    gen.publish(2, sinks=True)  # the source's newest warm is still 2: no switch
    assert states(gen, "127.0.0.2") == {1: R, 2: A, 3: W}
