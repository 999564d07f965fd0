"""Colocated rounds with the engine's memory released between them, one body for every
backend (gloo on CPU here; the GPU tier can run it on one GPU).

The trainer calls `Publisher.release()` before each training step and `publish()` after
it. Every round must still deliver bit-identical weights and the trainer's greedy output;
while released, the engine's own resident bytes (its /health) are down by what was
released and it refuses inference; after the round they are back. A gone engine fails
the next round (with released weights, at their wake: `engine_wake_failed`, naming its
pod). An agent restarted while its engine sleeps learns it from the engine.
"""

from __future__ import annotations

import re
import urllib.error
from pathlib import Path

import pytest
import torch

from tests.integration.contract import ContractConfig, expect_served, make_plan
from tests.integration.stack import (
    STARTUP_TIMEOUT,
    AgentProc,
    Engine,
    Stack,
    free_port,
    stack,
    wait_warm,
)
from tests.support.eventually import eventually
from weightsync.api.control import Backend
from weightsync.api.engines import MemoryTag, released_tags
from weightsync.api.reasons import FailureReason
from weightsync.api.v1alpha1 import MemoryRelease, SyncMode
from weightsync.client import Publisher
from weightsync.reference.model import PRESETS, build_model, randomize

KV_CACHE_BYTES = 8 << 20
# The engine's own log lines for a wake and a committed update, in the order they happened.
_EVENT = re.compile(r'resumed (\w+)|update phases \{"version":(\d+),"outcome":"committed"')


def engine_events(engine: Engine) -> list[str]:
    """ "wake <tag>" and "commit <version>", as the engine logged them."""
    text = engine.proc.log.read_text(errors="replace")
    return [f"wake {tag}" if tag else f"commit {v}" for tag, v in _EVENT.findall(text)]


def assert_refuses_inference(engine: Engine) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        engine.generate([[1, 2, 3]], 1)
    refused.value.close()  # its reply's socket
    assert refused.value.code == 503


def start_colocated_source(
    st: Stack, config: ContractConfig, engine: Engine, release: MemoryRelease
) -> AgentProc:
    """The trainer's agent, planned as `engine`'s Colocated source releasing `release`."""
    source = st.start_agent("source-0", role="source", device=config.devices[0])
    # Not `wait_ready`: it refuses a stack with a dead process (an agent killed before).
    eventually(source.status, timeout=STARTUP_TIMEOUT, interval=0.2, message="agent up")
    plan = make_plan(
        config, 1, 0, ["source-0"], free_port(), mode=SyncMode.COLOCATED, local_engine=engine
    )
    assert plan.local_engine is not None
    local = plan.local_engine.model_copy(update={"memory_release": release})
    source.put_plan(plan.model_copy(update={"local_engine": local}))
    wait_warm([source], 1, timeout=30.0)
    assert source.socket_path is not None
    return source


def device_free(device: str) -> int | None:
    """Free bytes on `device` as the driver counts them (every process's), None on CPU."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def run_colocated_release(
    workdir: Path,
    device: str,
    release: MemoryRelease,
    rounds: int = 3,
    kv_cache_bytes: int = KV_CACHE_BYTES,
) -> None:
    """On a GPU the release must also show on the device: the driver's free memory rises by
    what the engine says it gave back (a block still mapped by the agent, or kept in the
    engine's allocator cache, would not), and falls again once the round woke it."""
    config = ContractConfig(
        backend=Backend.NCCL if device.startswith("cuda") else Backend.GLOO, devices=[device]
    )
    tags = released_tags(release)
    with stack(workdir) as st:
        engine = st.start_engine(
            "engine-0", preset=config.preset, seed=0, device=device, kv_cache_bytes=kv_cache_bytes
        )
        st.wait_ready([], [engine])
        source = start_colocated_source(st, config, engine, release)
        trainer = build_model(PRESETS[config.preset], seed=0, device=device)
        model_bytes = sum(p.nbytes for p in trainer.parameters())
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            randomize(trainer, seed=3000)
            assert publisher.publish(trainer.named_parameters(), version=1).ok
            awake = engine.health()["resident_bytes"]
            for version in range(2, rounds + 2):
                before = device_free(device)
                freed = set(publisher.release())
                assert freed == {str(tag) for tag in tags}
                health = engine.health()
                assert health["detail"].startswith("sleeping")
                asleep = health["resident_bytes"]
                if MemoryTag.WEIGHTS in tags:  # both copies of the staged engine are gone:
                    assert awake >= kv_cache_bytes + 2 * model_bytes
                    assert asleep < 1024  # one placeholder element per tensor remains
                else:
                    assert asleep == awake - kv_cache_bytes
                after = device_free(device)
                if before is not None and after is not None:
                    # The allocator's rounding and the CUDA context's own pages: 5% slack.
                    assert after - before >= 0.95 * (awake - asleep), (before, after, awake, asleep)
                assert_refuses_inference(engine)
                randomize(trainer, seed=3000 + version)  # "training"
                result = publisher.publish(trainer.named_parameters(), version=version)
                assert result.ok, result
                expect_served(trainer, [engine], version)
                health = engine.health()
                assert (health["detail"], health["resident_bytes"]) == ("", awake)
                woken = device_free(device)
                if before is not None and woken is not None:
                    assert woken <= before + 0.05 * (awake - asleep), (before, woken)
            # The engine's own record: weights woken before each round's loads, the KV cache
            # only once the round committed.
            want = ["commit 1"]
            for version in range(2, rounds + 2):
                wake_weights = ["wake weights"] if MemoryTag.WEIGHTS in tags else []
                want += [*wake_weights, f"commit {version}", "wake kv_cache"]
            assert engine_events(engine) == want
            publisher.release()
            engine.proc.kill()
            failed = publisher.publish(trainer.named_parameters(), version=rounds + 2)
        assert not failed.ok
        if MemoryTag.WEIGHTS in tags:  # woken first: the wake is what fails
            assert failed.reason == FailureReason.ENGINE_WAKE_FAILED, failed
            assert "engine-0" in failed.message


def run_release_across_agent_restart(workdir: Path, device: str, release: MemoryRelease) -> None:
    """The trainer's agent restarts while its engine sleeps: the new agent asks the engine
    what it released, and the next publish wakes it in order (weights, round, KV cache),
    bit-identical, the engine awake with all its memory back."""
    config = ContractConfig(
        backend=Backend.NCCL if device.startswith("cuda") else Backend.GLOO, devices=[device]
    )
    tags = released_tags(release)
    with stack(workdir) as st:
        engine = st.start_engine(
            "engine-0", preset=config.preset, seed=0, device=device, kv_cache_bytes=KV_CACHE_BYTES
        )
        st.wait_ready([], [engine])

        source = start_colocated_source(st, config, engine, release)
        trainer = build_model(PRESETS[config.preset], seed=0, device=device)
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            randomize(trainer, seed=4000)
            assert publisher.publish(trainer.named_parameters(), version=1).ok
            awake = engine.health()["resident_bytes"]
            assert set(publisher.release()) == {str(tag) for tag in tags}
        assert engine.health()["released"] == sorted(tags)
        source.proc.kill()  # the sidecar restarts in place; the engine sleeps on

        source = start_colocated_source(st, config, engine, release)
        assert engine.health()["released"] == sorted(tags)  # asking woke nothing
        assert_refuses_inference(engine)
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            randomize(trainer, seed=4002)  # "training"
            result = publisher.publish(trainer.named_parameters(), version=2)
            assert result.ok, result
        expect_served(trainer, [engine], 2)
        health = engine.health()
        assert (health["detail"], health["released"], health["resident_bytes"]) == ("", [], awake)
        wake_weights = ["wake weights"] if MemoryTag.WEIGHTS in tags else []
        assert engine_events(engine) == ["commit 1", *wake_weights, "commit 2", "wake kv_cache"]
        asleep_seen = f"is asleep: {', '.join(sorted(tags))} released"
        assert asleep_seen in source.proc.log.read_text(errors="replace")
