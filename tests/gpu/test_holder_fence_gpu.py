"""The source's holder copy outlasts the round on GPU: `publish()` returns when the
engine serves, the Publisher fences before writing its tensors, and a copy the trainer
wrote under (no fence) is never held.

Run on a machine with 2 GPUs and the Mooncake transfer engine installed:
`pytest -m multigpu tests/gpu/test_holder_fence_gpu.py`. A Llama-3-8B-shaped model cut to
12 layers (7.3 GB bf16): its device-to-host copy (PCIe) takes several times its NVLink
broadcast, so the copy is still running when the round ends.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.integration.contract import ContractConfig, make_plan
from tests.integration.stack import AgentProc, Engine, Stack, free_port, http_json, wait_warm
from weightsync.api.control import Backend, Holding
from weightsync.client import Publisher
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import preset, state_dict_metas
from weightsync.transfer.buffers import slot_views, torch_dtype
from weightsync.transfer.held import held_checksum
from weightsync.transfer.layout import BucketLayout

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
PRESET, LAYERS = "llama3-8b", 12
CONFIG = ContractConfig(
    backend=Backend.NCCL,
    devices=["cuda:0", "cuda:1"],
    preset=PRESET,
    bucket_size_bytes=512 << 20,
    timeout_seconds=60.0,
    checksum=False,
)
P2P = {"WEIGHTSYNC_P2P_HOST": "127.0.0.21", "WEIGHTSYNC_P2P_PROTOCOL": "tcp"}


def trainer_tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cuda:0").manual_seed(seed)
    return {
        m.name: torch.randn(m.shape, generator=generator, device="cuda:0", dtype=torch.float32).to(
            torch_dtype(m.dtype)
        )
        for m in state_dict_metas(preset(PRESET, LAYERS), "bfloat16")
    }


def holding(agent: AgentProc) -> Holding:
    """The held version; the agent answers once its checksums are done (CRC-32 of 7.3 GB
    of host memory: seconds), and waits up to 60 s for them, so the client does too."""
    url = f"{agent.url}/v1/holding"
    return Holding.model_validate(http_json("GET", url, None, agent.token, timeout=70))


def expected_checksums(layout: BucketLayout, tensors: dict[str, torch.Tensor]) -> list[int]:
    """What a holder of exactly `tensors` reports, computed here from the tensors."""
    sums = []
    for bucket in layout.buckets:
        region = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for view, t in zip(slot_views(region, bucket.tensors), bucket.tensors, strict=True):
            view.copy_(tensors[t.name].cpu())
        sums.append(held_checksum(region, bucket))
    return sums


def served(engine: Engine, version: int, tensors: dict[str, torch.Tensor]) -> None:
    body = engine.digests(timeout=120)  # sha256 of 7.3 GB
    assert body["version"] == version
    assert body["tensors"] == {n: tensor_digest(t) for n, t in tensors.items()}


@pytest.mark.timeout(600)
def test_publish_returns_before_the_holder_copy_and_only_fenced_copies_are_held() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("mooncake.engine")
    args = ["--dtype", "bfloat16", "--no-init", "--layers", str(LAYERS)]
    st = Stack(Path(tempfile.mkdtemp(prefix="ws-fence-")), engine_args=args)
    try:
        engine = st.start_engine("engine-1", preset=PRESET, seed=0, device="cuda:1")
        sink = st.start_agent("sink-1", role="sink", device="cuda:1", engine=engine)
        source = st.start_agent("source-0", role="source", device="cuda:0", extra_env=P2P)
        st.wait_ready([source, sink], [engine])
        pods, port = ["source-0", "sink-1"], free_port()
        for rank, agent in enumerate((source, sink)):
            agent.put_plan(make_plan(CONFIG, 1, rank, pods, port))
        wait_warm([source, sink], 1, timeout=180.0)
        tensors = trainer_tensors(seed=1)
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=120.0) as publisher:
            # The first rounds are not held while the host buffers are pinned (seconds,
            # in the background): publish fenced versions until two in a row are held
            # (both buffers, the held one and the next round's, are ready).
            version, in_a_row, deadline = 0, 0, time.monotonic() + 120
            while in_a_row < 2:
                assert time.monotonic() < deadline, "the source never held two versions"
                version += 1
                assert publisher.publish(tensors, version=version).ok
                publisher.fence()
                in_a_row = in_a_row + 1 if source.status().holding == version else 0
            base = version

            # Fenced: publish() returned while the copy ran; the fence keeps it.
            torch.manual_seed(0)
            for t in tensors.values():
                t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
            started = time.perf_counter()
            result = publisher.publish(tensors, version=base + 1)
            returned = time.perf_counter() - started
            assert result.ok, result
            assert result.holding, "the 7.3 GB copy to host outlasts the NVLink round"
            served(engine, base + 1, tensors)
            started = time.perf_counter()
            assert publisher.fence()
            fenced = time.perf_counter() - started
            held = holding(source)
            assert held.version == base + 1
            layout = BucketLayout.from_json(held.layout)
            assert held.checksums == expected_checksums(layout, tensors)
            print(f"publish() {returned * 1000:.1f} ms, then fence() {fenced * 1000:.1f} ms")

            # Written under the copy (no fence): that copy is dropped, never held; from
            # then on publish() fences itself, and the next version is held exactly.
            assert publisher.publish(tensors, version=base + 2).holding
            for t in tensors.values():
                t.mul_(-1)
            assert source.status().holding == base + 1, "a copy is held only once fenced"
            assert publisher.publish(tensors, version=base + 3).ok
            assert publisher.fence_in_publish
            held = holding(source)
            assert held.version == base + 3, "the unfenced copy of base + 2 was dropped"
            assert held.checksums == expected_checksums(layout, tensors)
            served(engine, base + 3, tensors)
    except BaseException:
        print(st.logs())
        raise
    finally:
        st.close()
