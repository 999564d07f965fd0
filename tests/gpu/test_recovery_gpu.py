"""P2P recovery with GPU agents: holders stage on their GPUs, a fresh sink pulls into GPU
slots and loads its engine on its GPU. Mooncake over TCP (no RDMA NIC needed).

Run on a machine with 4 GPUs and the Mooncake transfer engine installed:
`pytest -m multigpu tests/gpu/test_recovery_gpu.py`. The source holds by default (from
the published tensors it maps), sink-2 holds by plan (from its slots).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.integration.contract import ContractConfig, expect_served, make_plan
from tests.integration.stack import AgentProc, Stack, free_port, http_json, stack, wait_warm
from tests.support.eventually import eventually
from weightsync.api.control import Backend, Holding, RecoverRequest, RecoveryState, RecoveryStatus
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.client import Publisher
from weightsync.reference.model import PRESETS, build_model, randomize

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
CONFIG = ContractConfig(
    backend=Backend.NCCL,
    devices=[f"cuda:{i}" for i in range(3)],
    preset="small",
    bucket_size_bytes=4 << 20,
    timeout_seconds=30.0,
    checksum=False,
)


def p2p_env(index: int) -> dict[str, str]:
    return {"WEIGHTSYNC_P2P_HOST": f"127.0.0.{21 + index}", "WEIGHTSYNC_P2P_PROTOCOL": "tcp"}


def sink(st: Stack, index: int) -> AgentProc:
    device = f"cuda:{index}"
    engine = st.start_engine(f"engine-{index}", preset=CONFIG.preset, seed=0, device=device)
    return st.start_agent(
        f"sink-{index}", role="sink", device=device, engine=engine, extra_env=p2p_env(index)
    )


def holding(agent: AgentProc) -> Holding:
    return Holding.model_validate(http_json("GET", f"{agent.url}/v1/holding", None, agent.token))


@pytest.mark.timeout(300)
def test_a_fresh_gpu_sink_recovers_bit_identical_from_gpu_holders(tmp_path: Path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    pytest.importorskip("mooncake.engine")
    trainer = build_model(PRESETS[CONFIG.preset], seed=0, device="cuda:0")
    with stack(tmp_path) as st:
        source = st.start_agent("source-0", role="source", device="cuda:0", extra_env=p2p_env(0))
        sinks = [sink(st, 1), sink(st, 2)]
        st.wait_ready([source, *sinks], [s.engine for s in sinks if s.engine is not None])
        agents = [source, *sinks]
        pods, port = [a.proc.name for a in agents], free_port()
        for rank, agent in enumerate(agents):
            plan = make_plan(CONFIG, 1, rank, pods, port)
            agent.put_plan(plan.model_copy(update={"holder": agent.proc.name == "sink-2"}))
        wait_warm(agents, 1, timeout=120.0)
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=120.0) as publisher:
            for version in (1, 2):
                randomize(trainer, seed=300 + version)
                result = publisher.publish(trainer.named_parameters(), version=version)
                assert result.ok, result
        held = {a.proc.name: holding(a) for a in (source, sinks[1])}
        assert {h.version for h in held.values()} == {2}
        # One from the published tensors, one from the slots: the same bytes.
        assert held["source-0"].checksums == held["sink-2"].checksums

        fresh = sink(st, 3)
        st.wait_ready([fresh], [fresh.engine] if fresh.engine else [])
        request = RecoverRequest(
            version=2, holders=[source.url, sinks[1].url], protocol=RecoveryProtocol.TCP
        )
        http_json("POST", f"{fresh.url}/v1/recover", request.model_dump_json(), fresh.token)

        def finished() -> RecoveryStatus | None:
            status = fresh.status().recovery
            done = status is not None and status.state in (RecoveryState.DONE, RecoveryState.FAILED)
            return status if done else None

        status = eventually(finished, timeout=120.0, interval=0.1, message="recovery over")
        assert status.state is RecoveryState.DONE, status
        assert status.bytes == held["source-0"].nbytes
        assert fresh.engine is not None
        expect_served(trainer, [fresh.engine], 2)
