"""An agent told to stop (SIGTERM, as the kubelet does) exits 0 and leaves nothing behind.

A source and a sink agent with a formed gloo group and a round's slots behind them: both
stopped with SIGTERM exit 0 within the kubelet's grace period, never abort (`terminate
called without an active exception` was the end of most shutdowns, exit -6), and leave
no shared-memory slot.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.integration.contract import ContractConfig, make_plan
from tests.integration.stack import free_port, stack, wait_warm
from weightsync.api.control import Backend
from weightsync.client import Publisher
from weightsync.reference.model import PRESETS, build_model

pytestmark = pytest.mark.timeout(120)

GRACE_SECONDS = 30  # the kubelet's default terminationGracePeriodSeconds


def test_sigterm_releases_the_group_and_slots_and_exits_zero(tmp_path: Path) -> None:
    config = ContractConfig(backend=Backend.GLOO, devices=["cpu", "cpu"], bucket_size_bytes=4096)
    with stack(tmp_path) as st:
        engine = st.start_engine("engine-1", preset="tiny", seed=0, device="cpu")
        sink = st.start_agent("sink-1", role="sink", device="cpu", engine=engine)
        source = st.start_agent("source-0", role="source", device="cpu")
        st.wait_ready([source, sink], [engine])
        pods, port = ["source-0", "sink-1"], free_port()
        for rank, agent in enumerate((source, sink)):
            agent.put_plan(make_plan(config, 1, rank, pods, port))
        wait_warm([source, sink], 1, timeout=60)
        assert source.socket_path is not None
        model = build_model(PRESETS["tiny"], seed=1)
        weights = {name: p.detach() for name, p in model.named_parameters()}
        with Publisher(source.socket_path, timeout=60) as publisher:
            assert publisher.publish(weights, version=1).ok
        time.sleep(2.0)  # every agent back at rest: the sink waits on the next doorbell
        for agent in (sink, source):
            pid = agent.proc.popen.pid
            assert list(Path("/dev/shm").glob(f"weightsync-{pid}-*")), "slots were allocated"
            agent.proc.popen.send_signal(signal.SIGTERM)
            assert agent.proc.popen.wait(timeout=GRACE_SECONDS) == 0, agent.proc.tail()
            assert "terminate called" not in agent.proc.tail()
            assert not list(Path("/dev/shm").glob(f"weightsync-{pid}-*")), "slots left behind"


def test_an_agent_without_its_gpu_exits_saying_how_the_sidecar_gets_one(tmp_path: Path) -> None:
    """This machine has no GPU, as a sidecar given none has: the agent must not start a
    group it cannot serve (nor fall back to a device it was not given)."""
    import torch

    assert torch.cuda.device_count() == 0, "a GPU machine: nothing to refuse here"
    with stack(tmp_path) as st:
        engine = {"WEIGHTSYNC_ENGINE": "Reference", "WEIGHTSYNC_ENGINE_URL": "http://127.0.0.1:1"}
        one = st.start_agent("sink-1", role="sink", device="cuda:0", extra_env=engine)
        several = st.start_agent(
            "trainer-0", role="source", device="cuda:0",
            extra_env={"WEIGHTSYNC_LOCAL_RANKS": "0,1", "WEIGHTSYNC_SOCKET": str(
                tmp_path / "agent-{local_rank}.sock")},
        )  # fmt: skip
        for agent in (one, several):
            assert agent.proc.popen.wait(timeout=60) == 2, agent.proc.tail()
            assert "not visible in this container, which sees 0 GPU(s)" in agent.proc.tail()
            assert "ResourceClaims" in agent.proc.tail()
