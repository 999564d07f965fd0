"""The bytes the adapters send open, in another process, into the tensors the agent holds.

This is the part SGLang and vLLM would do with our payloads, done with torch alone: the
engines cannot run here. On CPU the handle is torch's file-system shared memory; the GPU
variant of this test is in tests/gpu.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.engines.fakes.common import ALLOWED_GLOBALS, RestrictedUnpickler, digest
from tests.unit.engines.support import cpu_slots, make_model, pack, run
from weightsync.engines.base import EngineError
from weightsync.engines.sglang import SGLangAdapter, SGLangSettings
from weightsync.engines.vllm import SHM_BACKEND, VLLMAdapter
from weightsync.transfer.buffers import BucketSlots

REPO = Path(__file__).resolve().parents[3]


class _RecordingUnpickler(RestrictedUnpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add((module, name))
        return super().find_class(module, name)


def _globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a pickle imports; raises on one outside the allow-list."""
    unpickler = _RecordingUnpickler(data)
    unpickler.load()
    return unpickler.seen


def _read_in_subprocess(request: dict[str, object]) -> dict[str, dict[str, str]]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.engines.fakes.reader"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, dict[str, str]] = json.loads(done.stdout)
    return result


def test_payloads_open_in_another_process_bit_exact() -> None:
    model = make_model(3)
    named = list(model.items())
    expected = {name: digest(tensor) for name, tensor in named}

    async def build() -> dict[str, object]:
        slots = cpu_slots(2, 1 << 14)
        sglang = SGLangAdapter(SGLangSettings(base_url="http://127.0.0.1:1", tp_size=2))
        vllm = VLLMAdapter("http://127.0.0.1:1")
        await sglang.attach_buffers(slots)
        await vllm.attach_buffers(slots)
        # Two buckets in two slots, padded to 64-byte offsets and starting off zero.
        first = pack(slots[0], named[:4], start=128, align=64)
        second = pack(slots[1], named[4:], align=64)
        sglang_payloads = [
            payload
            for slot, bucket in ((0, first), (1, second))
            for payload in sglang.bucket_request(slot, bucket)["serialized_named_tensors"][:1]
        ]
        vllm_infos = [
            body["update_info"]
            for slot, bucket in ((0, first), (1, second))
            for body in vllm.bucket_requests(slot, bucket)
        ]
        return {"sglang": sglang_payloads, "vllm": vllm_infos}

    # The adapters are gone by the time the reader runs: each payload holds its own
    # reference to the shared memory until a reader maps it, as torch's reducer does.
    read = _read_in_subprocess(run(build()))
    assert read["sglang"] == expected
    assert read["vllm"] == expected


def test_sglang_payload_is_a_handle_with_allowed_globals_only() -> None:
    model = make_model(4)
    slots = cpu_slots(1, 1 << 16)
    adapter = SGLangAdapter(SGLangSettings(base_url="http://127.0.0.1:1", tp_size=2))
    run(adapter.attach_buffers(slots))
    bucket = pack(slots[0], list(model.items()))
    body = adapter.bucket_request(0, bucket)
    assert body["load_format"] == "flattened_bucket"
    payloads = body["serialized_named_tensors"]
    assert len(payloads) == 2
    bucket_bytes = sum(item.nbytes for item in bucket)
    for payload in payloads:
        raw = base64.b64decode(payload, validate=True)
        # A handle and metadata, not the tensor data (the bucket is 4x larger).
        assert len(raw) < bucket_bytes / 4
        seen = _globals(raw)
        assert seen <= ALLOWED_GLOBALS
        assert ("torch.multiprocessing.reductions", "rebuild_storage_filename") in seen
        assert ("types", "SimpleNamespace") in seen


def test_a_copy_per_worker_gives_sglang_a_payload_per_rank_reading_its_copy() -> None:
    """Two CPU copies (a sink serving an engine of two workers): without a tp_size SGLang
    gets one payload per copy, rank r's naming copy r; vLLM's map names both copies."""
    model = make_model(4)
    slots = cpu_slots(4, 1 << 16)  # two copies of two slots, grouped by copy
    sglang = SGLangAdapter("http://127.0.0.1:1")
    vllm = VLLMAdapter("http://127.0.0.1:1")
    run(sglang.attach_buffers(slots, copies=2))
    bucket = pack(slots[1], list(model.items()))
    assert pack(slots[3], list(model.items())) == bucket
    payloads = sglang.bucket_request(1, bucket)["serialized_named_tensors"]
    assert len(payloads) == 2
    for rank, payload in enumerate(payloads):
        read = pickle.loads(base64.b64decode(payload))  # noqa: S301 - our own payload
        flat = read["flattened_tensor"]
        lo = min(item.offset for item in bucket)
        assert torch.equal(flat, slots[1 + 2 * rank][lo : lo + flat.numel()])
    slots[3].zero_()  # copy 1 differs from now on: only rank 1 sees it
    run(sglang.attach_buffers(slots, copies=2))
    payloads = sglang.bucket_request(1, bucket)["serialized_named_tensors"]
    first, second = (pickle.loads(base64.b64decode(p))["flattened_tensor"] for p in payloads)  # noqa: S301
    assert bool(first.any())
    assert not bool(second.any())

    run(vllm.attach_buffers(slots, copies=2))
    vllm._shm_paths = []
    run(super(VLLMAdapter, vllm).attach_buffers(slots, copies=2))
    (body, *_) = vllm.bucket_requests(1, bucket)
    handles = pickle.loads(base64.b64decode(body["update_info"]["ipc_handles_pickled"]))  # noqa: S301
    assert sorted(handles) == ["cpu:0", "cpu:1"]
    with pytest.raises(ValueError, match="equal copies"):
        run(sglang.attach_buffers(slots[:3], copies=2))


def test_vllm_handles_name_the_slot_by_device_key() -> None:
    slots = cpu_slots(1, 4096)
    adapter = VLLMAdapter("http://127.0.0.1:1")
    run(adapter.attach_buffers(slots))
    bucket = pack(slots[0], [("w", torch.arange(8, dtype=torch.float32))], start=256)
    (body,) = adapter.bucket_requests(0, bucket)
    info = body["update_info"]
    assert set(info) == {"names", "dtype_names", "shapes", "ipc_handles_pickled", "tensor_sizes"}
    assert info["dtype_names"] == ["float32"]
    assert info["shapes"] == [[8]]
    assert info["tensor_sizes"] == [32]
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))  # noqa: S301
    assert list(handles) == ["cpu"]


def test_vllm_names_dev_shm_slots_by_path_for_the_shm_backend(tmp_path: Path) -> None:
    # An agent's CPU slots are files in shared memory: vLLM's weightsync_shm backend reads
    # them there, so the update names the file and the run's offset, and nothing is pickled.
    slots = BucketSlots(2, 4096, torch.device("cpu"), str(tmp_path))
    try:
        adapter = VLLMAdapter("http://127.0.0.1:1")
        run(adapter.attach_buffers(slots.slots))
        assert adapter.backend == SHM_BACKEND
        first, second = torch.arange(8, dtype=torch.float32), torch.ones(4, dtype=torch.int8)
        bucket = pack(slots.slots[1], [("a", first), ("b", second)], start=128)
        bucket.append(pack(slots.slots[1], [("c", first * 2)], start=1024)[0])  # a gap
        bodies = adapter.bucket_requests(1, bucket)
        runs = [body["update_info"] for body in bodies]
        assert [info["names"] for info in runs] == [["a", "b"], ["c"]]
        assert {frozenset(info) for info in runs} == {
            frozenset({"names", "dtype_names", "shapes", "tensor_sizes", "shm_path", "shm_offset"})
        }
        raw = Path(slots.handles.slots[1].path).read_bytes()
        for info in runs:
            assert info["shm_path"] == slots.handles.slots[1].path
            start, size = info["shm_offset"], sum(info["tensor_sizes"])
            assert (
                raw[start : start + size] == slots.slots[1][start : start + size].numpy().tobytes()
            )
        assert runs[1]["shm_offset"] == 1024
        with pytest.raises(EngineError, match="slot 2 of 2"):
            adapter.bucket_requests(2, bucket)
    finally:
        slots.close()
    plain = VLLMAdapter("http://127.0.0.1:1")
    run(plain.attach_buffers(cpu_slots(1, 4096)))
    assert plain.backend == "ipc"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_sglang_metadata_slices_rebuild_each_dtype(dtype: torch.dtype) -> None:
    from tests.unit.engines.fakes.common import restricted_loads

    slots = cpu_slots(1, 4096)
    adapter = SGLangAdapter("http://127.0.0.1:1")
    run(adapter.attach_buffers(slots))
    tensor = (torch.arange(24) - 7).to(dtype).reshape(2, 3, 4)
    bucket = pack(slots[0], [("x", torch.ones(3, dtype=torch.int8)), ("w", tensor)], align=16)
    (payload,) = adapter.bucket_request(0, bucket)["serialized_named_tensors"]
    loaded = restricted_loads(base64.b64decode(payload))
    meta = loaded["metadata"][1]
    flat = loaded["flattened_tensor"]
    rebuilt = flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
    assert torch.equal(rebuilt, tensor)
    assert meta.numel == meta.end_idx - meta.start_idx == tensor.numel() * tensor.element_size()
