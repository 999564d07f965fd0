"""A P2P holder as its own process: registers a byte pattern and waits for stdin to close.

    python -m tests.integration.p2p_holder --host 127.0.0.1 --nbytes N --seed S
prints one JSON line {"segment", "address", "nbytes"} once its memory is readable.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.transfer.p2p import TransferEngineEndpoint


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()
    held = pattern(args.nbytes, args.seed)
    endpoint = TransferEngineEndpoint(args.host, RecoveryProtocol.TCP)
    endpoint.register(held)
    print(
        json.dumps({"segment": endpoint.segment, "address": held.data_ptr(), "nbytes": args.nbytes})
    )
    sys.stdout.flush()
    sys.stdin.read()  # hold the memory until the test closes our stdin
    endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
