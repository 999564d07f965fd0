"""A trainer's Publisher, its source agent and one sink agent feeding a real engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.engines_real.rig import trainer
from tests.integration.contract import ContractConfig, apply_plan
from tests.integration.stack import free_port, stack
from tests.support.eventually import eventually
from weightsync.api.control import Backend
from weightsync.client import Publisher
from weightsync.reference.model import LlamaForCausalLM, randomize

CONFIG = ContractConfig(
    backend=Backend.GLOO,
    devices=["cpu", "cpu"],
    bucket_size_bytes=256 << 10,  # the 1.6 MB model in several buckets
    timeout_seconds=60.0,
)


def publish_versions(
    workdir: Path,
    engine: str,
    url: str,
    versions: list[int],
    check: Callable[[LlamaForCausalLM, int], None],
) -> None:
    """Publish `versions` through a source and a sink agent (gloo) into the engine at `url`;
    call `check(model, version)` after each round."""
    with stack(workdir) as st:
        env = {"WEIGHTSYNC_ENGINE": engine, "WEIGHTSYNC_ENGINE_URL": url}
        sink = st.start_agent("sink-1", role="sink", device="cpu", extra_env=env)
        source = st.start_agent("source-0", role="source", device="cpu")
        st.wait_ready([source, sink], [])
        apply_plan(CONFIG, [source, sink], generation=1, port=free_port())
        model = trainer(0)
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=120.0) as publisher:
            for version in versions:
                randomize(model, seed=3000 + version)
                result = publisher.publish(model.named_parameters(), version=version)
                assert result.ok, result
                # The sink books its commit just after the vote the source returns on.
                eventually(
                    lambda v=version: sink.status().version == v,
                    timeout=10,
                    message=f"the sink agent reports version {version}",
                )
                check(model, version)
