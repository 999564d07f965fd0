"""Failure semantics on gloo/CPU: what a trainer sees when engines restart, freeze, or it
passes bad input. Real agents and reference engines as local processes.

* An engine restarted in place (same address, other weights, as a kubelet restarts a
  crashed container) is behind whatever it reports, and the next round makes it serve
  exactly the trainer's bytes.
* A frozen engine (SIGSTOP) fails the round on every rank within the round's timeout,
  names the member and stage, and never freezes its agent's control API.
* Bad publisher input raises `PublishInputError` before anything is sent, and the next
  publish on the same Publisher works.
* A new Publisher is a new lineage: engines follow it from a lower version.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.contract import (
    ContractConfig,
    apply_plan,
    expect_served,
    publish_mid_round,
    start,
)
from tests.integration.stack import AgentProc, Engine, free_port, stack
from tests.support.eventually import eventually
from weightsync.api.control import Backend
from weightsync.client import Publisher, PublishInputError, PublishResult
from weightsync.reference.model import PRESETS, build_model, randomize

CONFIG = ContractConfig(
    backend=Backend.GLOO,
    devices=["cpu"] * 3,
    bucket_size_bytes=16 << 10,
    timeout_seconds=8.0,
    bucket_delay_seconds=0.02,
)
# What a failed round may take beyond its timeout: its failure path runs inside it, so
# only the agent's clock reading and process scheduling on two CI cores.
OVERRUN_SECONDS = 0.25


def _publish(publisher: Publisher, trainer: torch.nn.Module, version: int) -> PublishResult:
    result = publisher.publish(trainer.named_parameters(), version=version)
    assert result.ok, result
    return result


@pytest.mark.timeout(180)
def test_engine_restarted_in_place_is_behind_until_the_next_round(tmp_path: Path) -> None:
    with stack(tmp_path) as st:
        source, sinks = start(CONFIG, tmp_path, st)
        engines = [s.engine for s in sinks if s.engine is not None]
        apply_plan(CONFIG, [source, *sinks], generation=1, port=free_port())
        trainer = build_model(PRESETS[CONFIG.preset], seed=0, device="cpu")
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            randomize(trainer, seed=1)
            _publish(publisher, trainer, 1)
            expect_served(trainer, engines, 1)

            # The engine comes back at the same address with its start-up weights; its
            # agent must stop vouching for version 1 (its own word is not enough).
            victim = sinks[0]
            assert victim.engine is not None
            st.restart_engine(victim.engine, seed=99)
            behind = eventually(
                lambda: _behind(victim), timeout=10, interval=0.2, message="restart noticed"
            )
            assert behind.engine is not None
            assert behind.engine.version is None
            assert "restarted" in behind.engine.detail

            # The next rounds re-attach to the new process and deliver every byte.
            for version in (2, 3):
                randomize(trainer, seed=1 + version)
                _publish(publisher, trainer, version)
                expect_served(trainer, engines, version)
            engine_status = victim.status().engine
            assert engine_status is not None
            assert engine_status.version == 3


def _behind(agent: AgentProc) -> object:
    status = agent.status()
    engine = status.engine
    return status if engine is not None and engine.healthy and engine.version is None else None


@pytest.mark.timeout(180)
def test_frozen_engine_fails_the_round_in_time_and_names_it(tmp_path: Path) -> None:
    with stack(tmp_path) as st:
        source, sinks = start(CONFIG, tmp_path, st)
        engines = [s.engine for s in sinks if s.engine is not None]
        port = free_port()
        apply_plan(CONFIG, [source, *sinks], generation=1, port=port)
        trainer = build_model(PRESETS[CONFIG.preset], seed=0, device="cpu")
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            randomize(trainer, seed=1)
            _publish(publisher, trainer, 1)

            victim = sinks[-1]
            assert victim.engine is not None
            randomize(trainer, seed=2)
            failed, status_seconds = _publish_while_freezing(
                publisher, trainer, 2, victim, victim.engine
            )
            assert not failed.ok
            assert failed.member.startswith(victim.proc.name), failed
            assert failed.stage in {"engine_load", "engine_commit", "timeout"}, failed
            assert failed.duration_seconds < CONFIG.timeout_seconds + OVERRUN_SECONDS, failed
            print(  # the figure docs/reliability.md quotes (pytest -s)
                f"frozen engine: publish failed after {failed.duration_seconds:.2f} s"
                f" (timeout {CONFIG.timeout_seconds:.0f} s), status max {max(status_seconds):.3f} s"
            )
            # The frozen engine's agent answered its control API all along.
            assert max(status_seconds) < 1.0, status_seconds
            survivor = engines[0]
            assert survivor.health()["version"] == 1

            # Thawed, the engine gets the next round from a new plan, bit-exact.
            victim.engine.proc.popen.send_signal(signal.SIGCONT)
            apply_plan(CONFIG, [source, *sinks], generation=2, port=port)
            _publish(publisher, trainer, 2)
            expect_served(trainer, engines, 2)


def _publish_while_freezing(
    publisher: Publisher,
    trainer: torch.nn.Module,
    version: int,
    victim: AgentProc,
    engine: Engine,
) -> tuple[PublishResult, list[float]]:
    running = publish_mid_round(publisher, trainer, version, victim)
    engine.proc.popen.send_signal(signal.SIGSTOP)
    status_seconds: list[float] = []
    try:
        while running.thread.is_alive() and len(status_seconds) < 200:
            began = time.monotonic()
            victim.status()
            status_seconds.append(time.monotonic() - began)
            time.sleep(0.2)
        return running.result(), status_seconds
    finally:
        engine.proc.popen.send_signal(signal.SIGCONT)


@pytest.mark.timeout(180)
def test_bad_input_is_refused_and_a_new_lineage_is_followed(tmp_path: Path) -> None:
    with stack(tmp_path) as st:
        source, sinks = start(CONFIG, tmp_path, st)
        engines = [s.engine for s in sinks if s.engine is not None]
        apply_plan(CONFIG, [source, *sinks], generation=1, port=free_port())
        trainer = build_model(PRESETS[CONFIG.preset], seed=0, device="cpu")
        params = dict(trainer.named_parameters())
        first = next(iter(params))
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            randomize(trainer, seed=1)
            _publish(publisher, trainer, 5)

            bad: list[tuple[object, object, str]] = [
                (list(params.items()), -1, "version: must be >= 0"),
                (list(params.items()), "13", "version"),
                (list(params.items()), True, "version"),
                (list(params.items()), 1.5, "version"),
                (list(params.items()), 5, "version"),  # not above the last one published
                ([*params.items(), ("extra", np.zeros(3))], 6, "tensor 'extra'"),
                ([*params.items(), (first, params[first])], 6, f"tensor {first!r}"),
                ([], 6, "nothing to publish"),
            ]
            for tensors, version, says in bad:
                with pytest.raises(PublishInputError, match=says):
                    publisher.publish(tensors, version=version)  # type: ignore[arg-type]
            for engine in engines:
                assert engine.health()["version"] == 5

            # The same Publisher goes on as if nothing happened.
            randomize(trainer, seed=6)
            _publish(publisher, trainer, 6)
            expect_served(trainer, engines, 6)

        # A restarted trainer (a new Publisher) starts again from step 1: a new lineage.
        with Publisher(source.socket_path, timeout=60.0) as restarted:
            randomize(trainer, seed=7)
            result = _publish(restarted, trainer, 1)
            assert result.version == 1
            expect_served(trainer, engines, 1)
            assert source.status().lineage == restarted.lineage
            for sink in sinks:
                assert sink.status().lineage == restarted.lineage
