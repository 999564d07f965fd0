"""Serve a fake engine in a process of its own (so IPC handles cross a process boundary).

`python -m tests.unit.engines.fakes.run_fake {sglang|vllm} {cpu|cuda} [ranks]` serves a
fake holding a zeroed copy of `support.make_model()` on that device, prints "PORT <n>"
and runs until stdin closes. `ranks` is SGLang's TP size, or the number of vLLM workers,
worker r keyed by the UUID of GPU r (CUDA) or "cpu".
"""

from __future__ import annotations

import asyncio
import sys

import torch

from tests.unit.engines.fakes.common import serve
from tests.unit.engines.fakes.sglang_server import FakeSGLang
from tests.unit.engines.fakes.vllm_server import FakeVLLM
from tests.unit.engines.support import make_model, zeros_like_model


async def main(engine: str, device: str, ranks: int) -> None:
    model = {name: t.to(device) for name, t in zeros_like_model(make_model()).items()}
    fake: FakeSGLang | FakeVLLM
    if engine == "sglang":
        fake = FakeSGLang(model=model, tp_size=ranks)
    else:
        keys = tuple(
            "cpu" if device == "cpu" else str(torch.cuda.get_device_properties(rank).uuid)
            for rank in range(ranks)
        )
        fake = FakeVLLM(model=model, device_keys=keys)
    async with serve(fake.app()) as url:
        print("PORT", url.rsplit(":", 1)[1], flush=True)
        # Serve until the parent closes our stdin.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1))
