"""How long pinning a model-sized host buffer stalls CUDA calls in the same process.

    python -m tests.bench.bench_pinning [--gib 16] [--slice-mib 64 ...]

A holder pins its host buffers beside running rounds (`agent.host_memory`). Here one
thread pins a buffer while another times a tiny kernel and its synchronize every 5 ms, as
a round's small CUDA calls would run; each line gives the pinning time and the longest
stall of the probe. Variants: torch's `pin_memory=True` (one driver call), and
`PinnedBuffer` in slices of each `--slice-mib`, with and without a pause between slices.
Then a device-to-host copy into a `PinnedBuffer` over ten slices, cut at their edges
(`host_copies.within_slices`; one copy across an edge fails with `invalid argument`):
whether `non_blocking=True` returns before the copy is done, and the bytes.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import torch

from weightsync.agent import host_memory
from weightsync.agent.host_copies import within_slices
from weightsync.agent.host_memory import PinnedBuffer


def _probe(stop: threading.Event, stalls: list[float]) -> None:
    x = torch.ones(1024, device="cuda:0")
    while not stop.is_set():
        started = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        stalls.append(time.perf_counter() - started)
        time.sleep(0.005)


def measure(name: str, allocate: Callable[[], object]) -> object:
    stop, stalls = threading.Event(), []  # type: ignore[var-annotated]
    probe = threading.Thread(target=_probe, args=(stop, stalls))
    probe.start()
    time.sleep(0.3)
    started = time.perf_counter()
    buffer = allocate()
    took = time.perf_counter() - started
    stop.set()
    probe.join()
    print(f"{name:<48} pinned in {took:6.2f} s; longest probe {max(stalls) * 1000:8.1f} ms,"
          f" {len(stalls)} probes", flush=True)  # fmt: skip
    return buffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--slice-mib", type=int, nargs="+", default=[64])
    parser.add_argument("--copy-only", action="store_true", help="only the copy check")
    args = parser.parse_args()
    nbytes = args.gib << 30
    device = torch.device("cuda:0")
    torch.ones(1, device=device)
    if not args.copy_only:
        pin_variants(args, nbytes, device)
    copy_check(device)


def pin_variants(args: argparse.Namespace, nbytes: int, device: torch.device) -> None:
    pinned = measure(
        f"torch pin_memory=True, {args.gib} GiB",
        lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
    )
    del pinned
    for mib in args.slice_mib:
        host_memory._SLICE_BYTES = mib << 20
        for pause in (0.0, 0.002):
            host_memory._SLICE_PAUSE_SECONDS = pause
            buffer = measure(
                f"PinnedBuffer, {mib} MiB slices, pause {pause * 1000:.0f} ms",
                lambda: PinnedBuffer(nbytes, device),
            )
            assert isinstance(buffer, PinnedBuffer)
            buffer.release()
    host_memory._SLICE_BYTES = 64 << 20


def copy_check(device: torch.device) -> None:
    buffer = PinnedBuffer(1 << 30, device)
    source = torch.randint(0, 255, (600 << 20,), dtype=torch.uint8, device=device)
    target = buffer.tensor[(40 << 20) : (40 << 20) + source.numel()]  # crosses 10 slices
    pieces = within_slices([(target, source)], buffer.tensor.data_ptr(), buffer.slice_bytes)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for piece_target, piece_source in pieces:
        piece_target.copy_(piece_source, non_blocking=True)
    issued = time.perf_counter() - started
    torch.cuda.synchronize()
    done = time.perf_counter() - started
    same = torch.equal(target, source.cpu())
    rate = source.numel() / done / 2**30
    print(
        f"D2H 600 MiB into PinnedBuffer: call returned {issued * 1000:.2f} ms, done"
        f" {done * 1000:.2f} ms ({rate:.1f} GiB/s), bytes equal: {same}"
    )
    buffer.release()


if __name__ == "__main__":
    main()
