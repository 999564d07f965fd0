"""Broadcast benchmark: an 8B-shaped bf16 state dict from one trainer GPU to N-1 engines.

    python -m tests.bench.bench_broadcast [--gpus N] [--bucket-mib 512] [--reps 3]

One run measures, on the same GPUs:
* floor:     NCCL broadcast tensor by tensor from a process that holds the tensors;
* cold/warm: the first full broadcast on a fresh communicator, without and with the
             agent's pre-warm (barrier + small broadcast), and the pre-warm itself;
* weightsync: `Publisher.publish()` until every reference engine serves the version
             (real agents and engines, one process each);
* naive:     one broadcast plus one engine update request per tensor;
* colocated: trainer, agent and engine on GPU 0 (CUDA IPC hand-off) vs a D2D copy.
Ratios are to the floors measured in this run. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before torch/NCCL load; see module doc

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.bench.bench_workers import naive_worker, raw_worker, spawn_workers
from tests.integration.stack import AgentProc, Engine, Stack, free_port, wait_warm
from weightsync.api.control import (
    Backend,
    MembershipPlan,
    Mode,
    PlanMember,
    Rendezvous,
    Role,
    TransferOptions,
)
from weightsync.client import Publisher
from weightsync.engines.reference.model import PRESETS, state_dict_metas
from weightsync.transfer.buffers import torch_dtype

PRESET = "llama3-8b"
ENGINE_ARGS = ["--dtype", "bfloat16", "--no-init"]


@dataclass
class Row:
    name: str
    seconds: float
    nbytes: int
    floor: float | None = None

    def line(self) -> str:
        rate = self.nbytes / self.seconds / 2**30 if self.seconds > 0 else float("nan")
        ratio = f"{self.seconds / self.floor:6.2f}x" if self.floor else "      "
        return f"{self.name:<44} {self.seconds * 1000:10.2f} ms {rate:9.1f} GiB/s  {ratio}"


def trainer_state(device: str) -> dict[str, torch.Tensor]:
    """291 bf16 tensors of Llama-3-8B's shapes with cheap, non-constant contents."""
    state = {}
    for i, meta in enumerate(state_dict_metas(PRESETS[PRESET], "bfloat16")):
        tensor = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=device)
        tensor.fill_((i % 97) / 97.0)
        state[meta.name] = tensor
    torch.cuda.synchronize(device)
    return state


def plan_for(rank: int, pods: list[str], port: int, *, bucket: int, mode: Mode) -> MembershipPlan:
    return MembershipPlan(
        sync_name="bench",
        generation=1,
        rank=rank,
        backend=Backend.NCCL,
        mode=mode,
        rendezvous=Rendezvous(host="127.0.0.1", port=port),
        members=[
            PlanMember(rank=i, pod=p, host="127.0.0.1", role=Role.SOURCE if i == 0 else Role.SINK)
            for i, p in enumerate(pods)
        ],
        transfer=TransferOptions(bucket_size_bytes=bucket, pipeline_depth=2, timeout_seconds=120),
        prewarm_timeout_seconds=120,
    )


def timed_publishes(
    publisher: Publisher,
    state: dict[str, torch.Tensor],
    engines: list[Engine],
    first_version: int,
    reps: int,
) -> list[float]:
    """Wall time of `publish()` per round, each checked to be served by every engine."""
    times = []
    for version in range(first_version, first_version + reps):
        started = time.perf_counter()
        result = publisher.publish(state, version=version)
        elapsed = time.perf_counter() - started
        if not result.ok:
            raise RuntimeError(f"round {version} failed: {result}")
        for engine in engines:
            if engine.health()["version"] != version:
                raise RuntimeError(f"engine {engine.port} does not serve {version}")
        times.append(elapsed)
    return times


def start_engines_and_agents(
    st: Stack, gpus: int, colocated: bool
) -> tuple[AgentProc, list[AgentProc], list[Engine]]:
    engines, sinks = [], []
    if colocated:
        engine = st.start_engine("engine-0", preset=PRESET, seed=0, device="cuda:0")
        engines.append(engine)
        source = st.start_agent("source-0", role="source", device="cuda:0", engine=engine)
    else:
        for i in range(1, gpus):
            engine = st.start_engine(f"engine-{i}", preset=PRESET, seed=0, device=f"cuda:{i}")
            engines.append(engine)
            sinks.append(
                st.start_agent(f"sink-{i}", role="sink", device=f"cuda:{i}", engine=engine)
            )
        source = st.start_agent("source-0", role="source", device="cuda:0")
    st.wait_ready([source, *sinks], engines)
    return source, sinks, engines


def run_weightsync(
    args: argparse.Namespace, state: dict[str, torch.Tensor], colocated: bool
) -> tuple[list[float], float | None]:
    """Rounds through real agents and engines; returns round times and the pre-warm time."""
    workdir = Path(tempfile.mkdtemp(prefix="ws-bench-"))
    st = Stack(workdir, engine_args=ENGINE_ARGS)
    try:
        source, sinks, engines = start_engines_and_agents(st, args.gpus, colocated)
        agents = [source, *sinks]
        pods = [a.proc.name for a in agents]
        port = free_port()
        mode = Mode.COLOCATED if colocated else Mode.DISAGGREGATED
        for rank, agent in enumerate(agents):
            agent.put_plan(plan_for(rank, pods, port, bucket=args.bucket_mib << 20, mode=mode))
        wait_warm(agents, 1, timeout=180)
        prewarm = source.status().generations[0].prewarm_millis
        with Publisher(source.socket_path, timeout=600) as publisher:
            # The first round allocates the engines' staging copies: not timed.
            timed_publishes(publisher, state, engines, 1, 1)
            times = timed_publishes(publisher, state, engines, 2, args.reps)
        return times, None if prewarm is None else prewarm / 1000
    except BaseException:
        print(st.logs())
        raise
    finally:
        st.close()


def run_naive(args: argparse.Namespace) -> float:
    st = Stack(Path(tempfile.mkdtemp(prefix="ws-naive-")), engine_args=ENGINE_ARGS)
    try:
        engines = [
            st.start_engine(f"naive-engine-{i}", preset=PRESET, seed=0, device=f"cuda:{i}")
            for i in range(1, args.gpus)
        ]
        st.wait_ready([], engines)
        kwargs = {"version": 1, "engines": [e.url for e in engines]}
        result = spawn_workers(naive_worker, args.gpus, kwargs)
        stale = [e.port for e in engines if e.health()["version"] != 1]
    except BaseException:
        print(st.logs())
        raise
    finally:
        st.close()
    if stale:
        raise RuntimeError(f"naive: engines on ports {stale} do not serve version 1")
    return result["naive"]


def d2d_floor(state: dict[str, torch.Tensor], reps: int) -> float:
    sources = list(state.values())
    targets = [torch.empty_like(t) for t in sources]
    best = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        torch._foreach_copy_(targets, sources)
        torch.cuda.synchronize()
        best.append(time.perf_counter() - started)
    del targets
    torch.cuda.empty_cache()
    return statistics.median(best[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip", action="append", default=[], choices=["naive", "colocated"])
    args = parser.parse_args()
    if args.gpus < 2:
        raise SystemExit("needs at least 2 GPUs (one trainer, one engine)")
    metas = state_dict_metas(PRESETS[PRESET], "bfloat16")
    nbytes = sum(m.nbytes for m in metas)
    print(
        f"{len(metas)} tensors, {nbytes / 1e9:.2f} GB bf16; "
        f"1 trainer GPU -> {args.gpus - 1} engines"
    )

    raw = spawn_workers(raw_worker, args.gpus, {"reps": args.reps})
    print({k: round(v, 4) for k, v in raw.items()}, flush=True)
    floor = raw["floor"]
    rows = [
        Row("NCCL broadcast, tensor by tensor (floor)", floor, nbytes),
        Row("first broadcast, cold communicator", raw["cold_first"], nbytes, floor),
        Row("pre-warm (barrier + small broadcast)", raw["prewarm"], 0),
        Row("first broadcast after pre-warm", raw["warm_first"], nbytes, floor),
    ]

    state = trainer_state("cuda:0")
    times, agent_prewarm = run_weightsync(args, state, colocated=False)
    print(f"weightsync rounds: {[round(t, 4) for t in times]}", flush=True)
    rows.append(
        Row(
            f"weightsync publish() -> engines serve (median of {args.reps})",
            statistics.median(times),
            nbytes,
            floor,
        )
    )
    if agent_prewarm is not None:
        rows.append(Row("agent pre-warm of generation 1", agent_prewarm, 0))
    if "naive" not in args.skip:
        rows.append(
            Row("naive: broadcast + engine request per tensor", run_naive(args), nbytes, floor)
        )
    if "colocated" not in args.skip:
        d2d = d2d_floor(state, args.reps)
        rows.append(Row("D2D copy on one GPU (colocated floor)", d2d, nbytes))
        colo, _ = run_weightsync(args, state, colocated=True)
        rows.append(
            Row("colocated publish() -> engine serves", statistics.median(colo), nbytes, d2d)
        )
    print()
    for row in rows:
        print(row.line())


if __name__ == "__main__":
    main()
