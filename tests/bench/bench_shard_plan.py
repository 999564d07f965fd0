"""The host-side costs of a sharded round for a Qwen3-30B-A3B-shaped model, on CPU.

    python -m tests.bench.bench_shard_plan [--ranks 2] [--bucket-mib 1024]

A Qwen3-30B-A3B-shaped bf16 state dict (18,867 tensors, 61.1 GB: 48 layers of 128
experts) sharded FSDP2-style (dim 0) over `--ranks` trainer ranks. Measured here, with
no GPU and no data of that size:

* a rank's report as JSON (what each source rank offers in the store) and back;
* `plan_shards` over every rank's report (once per run: each agent caches it);
* the Python work of placing every staged piece per round (`SlotRoutes.place`), the
  first round (building the views) and a later one (kept views), on tensors of the same
  count but 8x16 elements, so the figure is the per-piece overhead, not bandwidth.
"""

from __future__ import annotations

import argparse
import time

import torch

from weightsync.reference.model import PRESETS, state_dict_metas
from weightsync.transfer.assembly import SlotRoutes
from weightsync.transfer.layout import TensorMeta
from weightsync.transfer.shards import Box, RankReport, plan_shards, staging_bound


def dim0_reports(metas: list[TensorMeta], ranks: int) -> list[RankReport]:
    """torch.chunk's dim-0 split (FSDP2's), as each rank reports it."""
    reports = []
    for rank in range(ranks):
        held: list[tuple[TensorMeta, Box | None]] = []
        for meta in metas:
            rows = meta.shape[0]
            step = -(-rows // ranks)
            start = min(rank * step, rows)
            count = max(0, min(step, rows - start))
            rest = meta.shape[1:]
            box = Box((start,) + (0,) * len(rest), (count, *rest)) if count else None
            held.append((meta, box))
        reports.append(RankReport(rank, tuple(held)))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=1024)
    args = parser.parse_args()
    metas = state_dict_metas(PRESETS["qwen3-30b-a3b"], "bfloat16")
    total = sum(m.nbytes for m in metas)
    print(f"{len(metas)} tensors, {total / 1e9:.1f} GB, {args.ranks} ranks (dim-0 shards)")
    reports = dim0_reports(metas, args.ranks)
    started = time.perf_counter()
    bodies = [r.to_json() for r in reports]
    back = [RankReport.from_json(b) for b in bodies]
    print(f"reports to JSON and back: {time.perf_counter() - started:.3f} s,"
          f" {len(bodies[0]) / 1e6:.2f} MB per rank")  # fmt: skip
    started = time.perf_counter()
    plan = plan_shards(back, args.bucket_mib << 20)
    print(f"plan_shards: {time.perf_counter() - started:.3f} s, {len(plan.layout.buckets)}"
          f" buckets, {sum(len(s) for s in plan.segments)} broadcasts per round, staging"
          f" {plan.staging_bytes / 2**20:.0f} MiB (bound"
          f" {staging_bound(plan.layout, args.ranks) / 2**20:.0f} MiB)")  # fmt: skip

    tiny = [TensorMeta(m.name, (8, 16), "bfloat16") for m in metas]
    tiny_plan = plan_shards(dim0_reports(tiny, args.ranks), 1 << 20)
    capacity = tiny_plan.layout.capacity_bytes + staging_bound(tiny_plan.layout, args.ranks)
    routes = SlotRoutes(tiny_plan, [torch.zeros(capacity, dtype=torch.uint8) for _ in range(2)])
    pieces = sum(len(s.pieces) for segments in tiny_plan.segments for s in segments)
    for label in ("first round (builds the views)", "later round (kept views)"):
        started = time.perf_counter()
        for bucket in range(len(tiny_plan.layout.buckets)):
            routes.place(bucket, bucket % 2)
        print(f"placing {pieces} pieces, {label}: {time.perf_counter() - started:.3f} s")


if __name__ == "__main__":
    main()
