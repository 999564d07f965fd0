"""The Publisher against a real source agent: renegotiation and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.contract import ContractConfig, make_plan
from tests.integration.stack import free_port, stack, wait_warm
from weightsync.api.control import Backend
from weightsync.client import AgentUnavailableError, Publisher


def test_no_agent_is_a_clear_error(tmp_path: Path) -> None:
    with (
        Publisher(tmp_path / "missing.sock") as publisher,
        pytest.raises(AgentUnavailableError, match="no weightsync agent"),
    ):
        publisher.publish({"w": torch.zeros(4)}, version=1)


def test_new_tensor_sets_renegotiate_and_a_dead_agent_is_reported(tmp_path: Path) -> None:
    config = ContractConfig(backend=Backend.GLOO, devices=["cpu"], bucket_size_bytes=4096)
    with stack(tmp_path) as st:
        source = st.start_agent("source-0", role="source", device="cpu")
        st.wait_ready([source], [])
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=30) as publisher:
            assert not publisher.attach({"w": torch.ones(8)}), "no plan yet: nothing to attach"
            early = publisher.publish({"w": torch.ones(8)}, version=1)
            assert not early.ok
            assert early.reason == "no_plan"

            source.put_plan(make_plan(config, 1, 0, ["source-0"], free_port()))
            wait_warm([source], 1, timeout=30)
            tensors = {"w": torch.ones(8), "b": torch.zeros(3)}
            assert publisher.attach(tensors)  # at start-up: mapped and planned before a round
            attached = publisher._layout
            assert attached is not None
            first = publisher.publish(tensors, version=1)
            assert first.ok, first
            assert publisher._layout is attached, "publish() attached again after attach()"
            assert first.bytes == 2 * 256
            timings = publisher.last_timings
            assert timings is not None
            assert timings.buckets == 1  # both tensors fit one 4 KiB bucket
            assert 0 <= timings.pack <= timings.total

            bigger = {"w": torch.ones(8), "b": torch.zeros(3), "e": torch.ones(2000)}
            second = publisher.publish(bigger, version=2)
            assert second.ok, second
            assert second.bytes == 2 * 256 + 8192  # the 8000-byte tensor gets a bucket alone
            assert publisher.last_timings is not None
            assert publisher.last_timings.buckets == 2
            assert source.status().version == 2

            source.proc.kill()
            with pytest.raises(AgentUnavailableError, match="went away"):
                publisher.publish(bigger, version=3)
