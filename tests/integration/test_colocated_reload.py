"""A Colocated engine restarted in place is reloaded by its trainer's agent, without a round.

Real agent and reference engine processes (gloo; POSIX shared memory stands in for CUDA
IPC here): after two rounds the engine is killed and started again at the same address
on other weights, as a kubelet restarts a crashed container. No `publish()` follows: the
source agent finds the engine serving its start-up weights and loads the version it holds
in host memory; the engine then serves the trainer's bytes exactly, and the next round
reaches it as before.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.contract import ContractConfig, expect_served, make_plan
from tests.integration.stack import free_port, stack, wait_warm
from tests.support.eventually import eventually
from weightsync.api.control import Backend
from weightsync.api.v1alpha1 import SyncMode
from weightsync.client import Publisher
from weightsync.reference.model import PRESETS, build_model, randomize


def test_a_colocated_engine_restarted_in_place_is_reloaded_without_a_round(
    tmp_path: Path,
) -> None:
    run_colocated_reload(tmp_path, "cpu")


def run_colocated_reload(workdir: Path, device: str) -> None:
    """Also on a GPU (`tests/gpu`): CUDA IPC slots, and the held copy kept at the fence."""
    config = ContractConfig(
        backend=Backend.NCCL if device.startswith("cuda") else Backend.GLOO, devices=[device]
    )
    with stack(workdir) as st:
        engine = st.start_engine("engine-0", preset=config.preset, seed=0, device=device)
        source = st.start_agent("source-0", role="source", device=device)
        st.wait_ready([source], [engine])
        trainer = build_model(PRESETS[config.preset], seed=0, device=device)
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            plan = make_plan(config, 1, 0, ["source-0"], free_port(),
                             mode=SyncMode.COLOCATED, local_engine=engine)  # fmt: skip
            source.put_plan(plan)
            wait_warm([source], 1, timeout=30.0)
            for version in (1, 2):
                publisher.fence()  # the trainer is about to write its tensors
                randomize(trainer, seed=3000 + version)
                result = publisher.publish(trainer.named_parameters(), version=version)
                assert result.ok, result
            expect_served(trainer, [engine], 2)
            publisher.fence()  # on a GPU the held copy of version 2 is kept here
            assert source.status().holding == 2

            st.restart_engine(engine, seed=7)  # its start-up weights, no version
            eventually(lambda: engine.health().get("version") == 2, timeout=30.0,
                       message="the engine reloaded with version 2")  # fmt: skip
            expect_served(trainer, [engine], 2)
            assert "reloaded the colocated engine of engine-0: version 2" in source.proc.tail(200)

            randomize(trainer, seed=3003)  # rounds go on: the slots were attached anew
            result = publisher.publish(trainer.named_parameters(), version=3)
            assert result.ok, result
            expect_served(trainer, [engine], 3)
