"""Sharded-source broadcast benchmark: S trainer GPUs publish FSDP2-style shards to engines.

    python -m tests.bench.bench_sharded --sources 2 [--gpus 4]
                                        [--preset llama3-8b|qwen3-30b-a3b] [--layers N]
                                        [--configs 1024x2,512x2] [--reps 5] [--holder]
                                        [--smoke]

Trainer ranks 0..S-1 are one process each (cuda:r), one torch.distributed group among
them, holding every tensor of the preset as a `Shard(0)` DTensor over a 1-D mesh of the S
ranks; each builds only its own rows (`bench_sharded_workers`), so a trainer GPU holds
about 1/S of the model. Every rank runs its own `Publisher` to its own source agent
(cuda:r); sink agents and reference engines sit on GPUs S..G-1. A round: every rank
refills its shards (in place, a new version), meets the others at a barrier, then calls
`publish()`; the round's time is the slowest rank's, from the barrier until its publish()
returned, and the bench checks that every engine then serves the version. After the last
round every engine's digests must equal the full tensors', bit for bit.

Floors, measured in the same run over all G GPUs by raw NCCL processes: each owner's
bytes as one buffer (S broadcasts, one root each), and each owner's shards one broadcast
each. The target: publish() within 1.25x of the one-buffer floor. One group generation
per configuration (bucket MiB x pipeline depth); its first rounds are not timed, the
first is reported apart (with `--holder`, the holder's first copy is in it). Agents run
without a P2P holder unless `--holder`.

With two sources no dim 0 of these presets is odd, so every shard is even; `--sources 3`
cuts most tensors unevenly (the header line counts them).

`--smoke` runs the machinery on CPU (gloo, the "uneven" preset, KiB buckets, at most two
timed rounds, floors on gloo): a check of the benchmark itself, not a measurement.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before torch/NCCL load; see bench_broadcast

import json
import statistics
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.bench.bench_broadcast import (
    AGENT_ENV,
    DISAGGREGATED_TARGET,
    WARMUP_ROUNDS,
    Row,
    Shape,
    engine_args,
    machine_lines,
)
from tests.bench.bench_phases import read_summaries
from tests.bench.bench_sharded_workers import (
    RankReply,
    Trainers,
    floor_worker,
    model_metas,
    uneven,
)
from tests.bench.bench_workers import spawn_workers
from tests.integration.stack import AgentProc, Engine, Stack, free_port, wait_warm
from tests.support.plans import local_plan
from weightsync.agent.trace import PHASES_LOG_PREFIX
from weightsync.api.control import Backend, TransferOptions

DIGEST_SECONDS = 900.0  # sha256 of a whole model, per engine


@dataclass
class Bench:
    """Where it runs and what it sends."""

    args: argparse.Namespace
    backend: Backend
    unit: int  # bytes per bucket-size unit: MiB, or KiB in the smoke run

    @property
    def sources(self) -> int:
        return int(self.args.sources)

    def device(self, index: int) -> str:
        return f"cuda:{index}" if self.backend == Backend.NCCL else "cpu"

    def kwargs(self) -> dict[str, Any]:
        return {
            "preset": self.args.preset,
            "layers": self.args.layers,
            "backend": self.backend.value,
            "check": self.backend == Backend.GLOO,  # small models: compare with distribute_tensor
        }

    def label(self, shape: Shape) -> str:
        unit = "MiB" if self.unit == 1 << 20 else "KiB"
        return f"{shape.bucket_mib} {unit} buckets, depth {shape.depth}"


@dataclass
class Config:
    label: str
    first: float  # the generation's first round (untimed), slowest rank
    rounds: list[float] = field(default_factory=list)  # timed rounds, slowest rank each
    served: list[float] = field(default_factory=list)  # the agents' own round times
    fences: list[float] = field(default_factory=list)  # fence() after each timed publish()
    spread: list[list[float]] = field(default_factory=list)  # per timed round, per rank
    # The slowest rank's Publisher timings per timed round (`PublishTimings`, seconds)
    timings: list[dict[str, float]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # of the timed rounds

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)


def start_stack(st: Stack, bench: Bench, agent_env: dict[str, str]) -> list[AgentProc]:
    """Source agents on the trainer devices, then a sink agent and engine per other device;
    returns the agents in rank order (sources first)."""
    sources = [
        st.start_agent(f"source-{r}", role="source", device=bench.device(r), extra_env=agent_env)
        for r in range(bench.sources)
    ]
    sinks = []
    for i in range(bench.sources, bench.args.gpus):
        device = bench.device(i)
        engine = st.start_engine(f"engine-{i}", preset=bench.args.preset, seed=0, device=device)
        sinks.append(
            # One GPU per engine: this host's agents see every GPU, where a sidecar sees
            # only its engine's (unset, a sink would copy each bucket to the GPUs after
            # its own, for a tensor-parallel engine).
            st.start_agent(f"sink-{i}", role="sink", device=device, engine=engine,
                           extra_env={**agent_env, "WEIGHTSYNC_ENGINE_DEVICES": "1"})
        )  # fmt: skip
    agents = [*sources, *sinks]
    st.wait_ready(agents, [s.engine for s in sinks if s.engine is not None])
    return agents


def apply_plans(
    bench: Bench, agents: list[AgentProc], generation: int, port: int, shape: Shape
) -> None:
    pods = [a.proc.name for a in agents]
    transfer = TransferOptions(
        bucket_size_bytes=shape.bucket_mib * bench.unit,
        pipeline_depth=shape.depth,
        timeout_seconds=120,
    )
    for rank, agent in enumerate(agents):
        agent.put_plan(
            local_plan(
                pods, rank, generation=generation, port=port, backend=bench.backend,
                transfer=transfer, sync_name="bench-sharded", prewarm_timeout_seconds=120,
                sources=bench.sources,
            )
        )  # fmt: skip
    wait_warm(agents, generation, timeout=180)


def check_round(replies: list[RankReply], engines: list[Engine], version: int) -> None:
    for reply in replies:
        if not reply.ok:
            raise RuntimeError(f"round {version}, trainer rank {reply.rank}: {reply.result}")
    for engine in engines:
        if engine.health()["version"] != version:
            raise RuntimeError(f"engine {engine.port} does not serve {version}")


def engine_digests(engine: Engine) -> dict[str, Any]:
    """`Engine.digests` with room for a whole model's sha256."""
    url = f"{engine.url}/v1/weights/digest"
    with urllib.request.urlopen(url, timeout=DIGEST_SECONDS) as response:  # noqa: S310 - ours
        body: dict[str, Any] = json.loads(response.read())
        return body


def check_bytes(trainers: Trainers, engines: list[Engine], version: int) -> None:
    """Every engine's tensors, bit for bit, against the full tensors of `version`."""
    with ThreadPoolExecutor(len(engines) + 1) as pool:
        served = list(pool.map(engine_digests, engines))
        expected = trainers.digests(version)
    for engine, body in zip(engines, served, strict=True):
        if body["version"] != version:
            raise RuntimeError(f"engine {engine.port} serves {body['version']}, not {version}")
        wrong = [n for n, d in expected.items() if body["tensors"].get(n) != d]
        if wrong or body["tensors"].keys() != expected.keys():
            raise RuntimeError(
                f"engine {engine.port}: {len(wrong)} tensors differ from the trainer's,"
                f" e.g. {wrong[:3]}; names equal: {body['tensors'].keys() == expected.keys()}"
            )
    print(f"bytes: {len(engines)} engines serve version {version} bit for bit", flush=True)


def run_sharded(bench: Bench) -> list[Config]:
    """Rounds through real agents and engines, one group generation per configuration."""
    args = bench.args
    st = Stack(Path(tempfile.mkdtemp(prefix="ws-bench-sharded-")),
               engine_args=engine_args(args.layers))  # fmt: skip
    configs: list[Config] = []
    trainers: Trainers | None = None
    try:
        agents = start_stack(st, bench, {} if args.holder else AGENT_ENV)
        engines = [a.engine for a in agents if a.engine is not None]
        sockets = [str(a.socket_path) for a in agents[: bench.sources]]
        trainers = Trainers(sockets, bench.kwargs())
        port, version = free_port(), 0
        for generation, shape in enumerate(args.shapes, start=1):
            apply_plans(bench, agents, generation, port, shape)
            config: Config | None = None
            for rep in range(WARMUP_ROUNDS + args.reps):
                version += 1
                replies = trainers.publish(version)
                check_round(replies, engines, version)
                slowest = max(r.elapsed for r in replies)
                if config is None:
                    config = Config(bench.label(shape), first=slowest)
                if rep >= WARMUP_ROUNDS:
                    config.rounds.append(slowest)
                    config.served.append(max(r.duration_seconds for r in replies))
                    config.fences.append(max(r.fence for r in replies))
                    config.spread.append([round(r.elapsed, 4) for r in replies])
                    slowest_reply = max(replies, key=lambda r: r.elapsed)
                    config.timings.append(slowest_reply.timings or {})
                    config.versions.append(version)
            assert config is not None
            configs.append(config)
            print(f"{config.label}: first {config.first:.4f} s, per rank {config.spread}",
                  flush=True)  # fmt: skip
            print(f"{config.label}: the slowest rank's Publisher (median ms) "
                  f"{publisher_phases(config.timings)}", flush=True)  # fmt: skip
            order = sorted(range(len(config.rounds)), key=config.rounds.__getitem__)
            median = config.versions[order[(len(order) - 1) // 2]]  # a round's, not a mean
            for line in agent_phases(agents, median):
                print(f"  {line}", flush=True)
        check_bytes(trainers, engines, version)
    except BaseException:
        print(st.logs())
        raise
    finally:
        if trainers is not None:
            trainers.close()
        st.close()
    return configs


def agent_phases(agents: list[AgentProc], version: int) -> list[str]:
    """Each agent's phase trace of round `version` (`agent.trace.PhaseTrace`): its spans
    as total/max ms, its marks, and its GPU marks' last times."""
    lines = []
    for agent in agents:
        for summary in read_summaries(agent.proc.log, PHASES_LOG_PREFIX):
            if int(summary.get("version", -1)) != version:
                continue
            spans = {k: f"{v[1]:.1f}/{v[2]:.1f}" for k, v in summary.get("spans", {}).items()}
            gpu = {k: v[-1] for k, v in summary.get("gpu_ms", {}).items()}
            lines.append(
                f"{agent.proc.name} v{version} total {summary.get('total_ms')} ms;"
                f" spans total/max {spans}; marks {summary.get('marks')}; gpu {gpu}"
            )
    return lines


def publisher_phases(timings: list[dict[str, float]]) -> dict[str, float]:
    """Each `PublishTimings` field's median over the rounds, in ms (counts as they are):
    `prepare` is before the round's message, `pack` the Publisher's bucket copies."""
    keys = sorted({k for t in timings for k in t})
    scale = {k: 1.0 if k == "buckets" else 1e3 for k in keys}
    return {k: round(statistics.median(t.get(k, 0.0) for t in timings) * scale[k], 2) for k in keys}


def report(bench: Bench, configs: list[Config], buffer: float | None, nbytes: int) -> None:
    """Each configuration's rows (a Row prints itself), then the target's verdicts."""
    holder = "holding" if bench.args.holder else "no holder"
    for c in configs:
        Row(
            f"{bench.sources} ranks publish() -> engines serve, {c.label}", c.median, nbytes, buffer
        )
        Row(f"  first round of the generation ({holder})", c.first, nbytes, buffer)
        if bench.args.holder:
            Row(
                "  agents' round (every engine committed)",
                statistics.median(c.served),
                nbytes,
                buffer,
            )
            Row("  fence() after publish(): the rest of the holder's copy",
                statistics.median(c.fences), 0)  # fmt: skip
    print()
    for c in configs:
        head = f"target publish <= {DISAGGREGATED_TARGET}x one-buffer floor, {c.label}:"
        if buffer is None:
            print(f"{head} no floor measured")
            continue
        ratio = c.median / buffer
        print(f"{head} {ratio:.2f}x {'met' if ratio <= DISAGGREGATED_TARGET else 'missed'}")


def floor_rows(bench: Bench, nbytes: int) -> float | None:
    """The raw floors over every device; returns the one-buffer floor."""
    if bench.args.skip_floors:
        return None
    kwargs = {**bench.kwargs(), "sources": bench.sources, "reps": bench.args.reps}
    floors = spawn_workers(floor_worker, bench.args.gpus, kwargs)
    wire, s = bench.backend.value.upper(), bench.sources
    Row(f"{wire} one buffer per owner ({s} roots -> all) (floor)", floors["one_buffer"], nbytes)
    Row(
        f"{wire} shard by shard ({s} roots -> all)",
        floors["shard_by_shard"],
        nbytes,
        floors["one_buffer"],
    )
    return floors["one_buffer"]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sources", type=int, default=2, help="trainer GPUs (shard owners)")
    parser.add_argument("--gpus", type=int, default=None, help="all GPUs: sources + engines")
    parser.add_argument(
        "--configs", default="1024x2,512x2", help="bucket MiB x pipeline depth, comma-separated"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--holder", action="store_true", help="agents hold for P2P recovery (needs Mooncake)"
    )
    parser.add_argument("--preset", default=None, help="llama3-8b (default), qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers")
    parser.add_argument("--skip-floors", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU check of the bench itself")
    args = parser.parse_args()
    args.shapes = Shape.parse(args.configs)
    if args.smoke:
        args.preset = args.preset or "uneven"
        args.gpus = args.gpus or args.sources + 2
        args.reps = min(args.reps, 2)
        if args.configs == parser.get_default("configs"):
            args.shapes = [Shape(16, 2), Shape(64, 3)]  # KiB in the smoke run
    else:
        args.preset = args.preset or "llama3-8b"
        args.gpus = args.gpus or torch.cuda.device_count()
    if not 0 < args.sources < args.gpus:
        raise SystemExit(f"needs at least one engine GPU beside {args.sources} sources")
    return args


def main() -> None:
    args = parse()
    backend = Backend.GLOO if args.smoke else Backend.NCCL
    bench = Bench(args, backend, unit=1 << 10 if args.smoke else 1 << 20)
    metas = model_metas(bench.kwargs())
    nbytes = sum(m.nbytes for m in metas)
    odd = uneven(metas, args.sources)
    for line in [] if args.smoke else machine_lines(args.gpus):
        print(line)
    print(
        f"{args.preset}, {args.layers or 'all'} layers: {len(metas)} tensors, "
        f"{nbytes / 1e6:,.1f} MB bf16, Shard(0) over {args.sources} trainer ranks "
        f"(uneven first dims: {len(odd)}{', e.g. ' + odd[0] if odd else ''}); "
        f"{args.gpus - args.sources} engines; {backend.value}; "
        f"configurations: {[bench.label(s) for s in args.shapes]}",
        flush=True,
    )
    buffer = floor_rows(bench, nbytes)
    configs = run_sharded(bench)
    report(bench, configs, buffer, nbytes)


if __name__ == "__main__":
    main()
