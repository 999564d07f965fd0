"""Read weight payloads the way the engines do, in a process of their own.

Run as `python -m tests.unit.engines.fakes.reader` with a JSON request on stdin:
{"sglang": [<base64 payload>, ...], "vllm": [<update_info>, ...]}. Prints
{"sglang": {name: sha256}, "vllm": {name: sha256}} of the bytes each tensor holds.

SGLang payloads go through the allow-list unpickler and FlattenedTensorBucket's slicing;
vLLM's through `pickle.loads` (what ipc_engine.py calls) and its packed consumer's split.
Being a separate process, this proves the handles open shared memory, not a local object.
"""

from __future__ import annotations

import base64
import json
import pickle
import sys
from typing import Any

import torch
from torch.multiprocessing import reductions

from tests.unit.engines.fakes.common import digest, local_cuda_index, restricted_loads


def read_sglang(payload: str) -> dict[str, str]:
    bucket = restricted_loads(base64.b64decode(payload, validate=True))
    flat = bucket["flattened_tensor"]
    return {
        meta.name: digest(flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape))
        for meta in bucket["metadata"]
    }


def read_vllm(update_info: dict[str, Any]) -> dict[str, str]:
    handles = pickle.loads(base64.b64decode(update_info["ipc_handles_pickled"]))  # noqa: S301
    (key, args), *_ = handles.items()
    if key == "cpu":
        packed = reductions.rebuild_tensor(*args)
    else:
        # The worker whose GPU has this UUID puts its own device index in args[6].
        args = list(args)
        args[6] = local_cuda_index(key)
        packed = reductions.rebuild_cuda_tensor(*args)
    sizes = update_info["tensor_sizes"]
    pieces = packed[: sum(sizes)].split(sizes)
    return {
        name: digest(piece.view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, piece in zip(
            update_info["names"],
            update_info["dtype_names"],
            update_info["shapes"],
            pieces,
            strict=True,
        )
    }


def main() -> None:
    request = json.load(sys.stdin)
    out: dict[str, dict[str, str]] = {"sglang": {}, "vllm": {}}
    for payload in request.get("sglang", []):
        out["sglang"].update(read_sglang(payload))
    for info in request.get("vllm", []):
        out["vllm"].update(read_vllm(info))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
