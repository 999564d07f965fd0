"""Broadcast benchmark: an 8B-shaped bf16 state dict from one trainer GPU to N-1 engines.

    python -m tests.bench.bench_broadcast [--gpus N] [--configs 512x2,1024x2,512x3]
                                          [--reps 5] [--skip naive|colocated|http]
                                          [--holder] [--preset llama3-8b|qwen3-30b-a3b]
                                          [--layers N] [--engine-tp N]

`--preset qwen3-30b-a3b` sends a Qwen3-30B-A3B-shaped state dict instead (18,867 tensors,
61.1 GB): the many-small-tensors case, where the one-buffer broadcast is the floor that
counts (tensor by tensor, NCCL pays a launch per tensor). `--layers N` keeps the preset's
first N layers: the same tensor shapes on GPUs too small for the whole model (a reference
engine stages a second copy of its weights during a round). `--engine-tp N` serves the
engine GPUs as engines of N tensor-parallel workers each (one sink agent per engine,
receiving on its first GPU and copying each bucket to the others).

One run measures, on the same GPUs:
* floor:     NCCL broadcast tensor by tensor from a process that holds the tensors, and
             for reference one buffer broadcast in chunks of each bucket size;
* cold/warm: the first full broadcast on a fresh communicator, without and with the
             agent's pre-warm (barrier + small broadcast), and the pre-warm itself;
* weightsync: `Publisher.publish()` until every reference engine serves the version
             (real agents and engines, one process each), per configuration (bucket
             MiB x pipeline depth), plus the first configuration with the engines'
             update channel off (HTTP per bucket, the engine copies from the slot);
* naive:     one broadcast plus one HTTP engine update request per tensor;
* colocated: trainer, agent and engine on GPU 0 (CUDA IPC hand-off: the agent packs the
             trainer's tensors into the engine's staging arenas) vs a D2D copy.
Ratios are to the floors measured in this run; a phase breakdown of each configuration's
median round follows the table. NVLink multicast stays off. Agents run without a P2P
holder (WEIGHTSYNC_HOLDER=false): a holder copies every bucket to pinned host memory
during the round, a cost of the recovery feature measured by `bench_p2p`, not here.

`--smoke` runs the weightsync and colocated parts on CPU (gloo, a small model): a check
of the benchmark's own machinery, not a measurement.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before torch/NCCL load; see module doc

import datetime
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.bench.bench_phases import RoundRecord, attach_logs, breakdown, median_record
from tests.bench.bench_workers import naive_worker, raw_worker, spawn_workers
from tests.integration.stack import AgentProc, Engine, Stack, free_port, wait_warm
from tests.support.plans import local_plan
from weightsync.api.control import Backend, MembershipPlan, TransferOptions
from weightsync.api.v1alpha1 import SyncMode
from weightsync.client import Publisher, PublishResult
from weightsync.reference.model import preset, state_dict_metas
from weightsync.transfer.buffers import torch_dtype

ENGINE_ARGS = ["--dtype", "bfloat16", "--no-init"]
AGENT_ENV = {"WEIGHTSYNC_HOLDER": "false"}  # see the module doc
# `--holder-ab`: the agents' switch, for measuring only, that lets the held copy queue
# device-to-host copies while a round votes (`agent.host_copies.VoteGate`).
THROUGH_VOTES = "WEIGHTSYNC_MEASURE_HOLDER_COPIES_THROUGH_VOTES"
WARMUP_ROUNDS = 2  # per configuration: new slots, staging arenas, and their mappings
PINNING_PROBE_ROUNDS = 5  # with a holder: rounds timed right after attach, while it pins
PINNING_SECONDS = 300  # at most, for a holding source's buffers after attach
DISAGGREGATED_TARGET = 1.25
COLOCATED_TARGET = 1.3  # one copy where the engine hands out its staging memory


@dataclass
class Row:
    name: str
    seconds: float
    nbytes: int
    floor: float | None = None

    def __post_init__(self) -> None:
        print(self.line(), flush=True)  # as soon as measured: a cut-off run keeps its rows

    def line(self) -> str:
        rate = self.nbytes / self.seconds / 2**30 if self.seconds > 0 else float("nan")
        ratio = f"{self.seconds / self.floor:6.2f}x" if self.floor else "      "
        return f"{self.name:<58} {self.seconds * 1000:10.2f} ms {rate:9.1f} GiB/s  {ratio}"


@dataclass
class Setup:
    """Where the benchmark runs: GPUs and NCCL, or CPU and gloo for `--smoke`."""

    preset: str
    layers: int | None  # None: every layer of the preset
    backend: Backend
    devices: list[str]  # rank order: the trainer's first
    engine_tp: int = 1  # engine GPUs per engine (tensor-parallel workers)

    def sync(self) -> None:
        if self.backend == Backend.NCCL:
            torch.cuda.synchronize()


@dataclass(frozen=True)
class Shape:
    """One configuration of the transfer: bucket size and pipeline depth."""

    bucket_mib: int
    depth: int

    @classmethod
    def parse(cls, text: str) -> list[Shape]:
        shapes = []
        for item in text.split(","):
            mib, _, depth = item.strip().partition("x")
            shapes.append(cls(int(mib), int(depth or 2)))
        return shapes

    def label(self) -> str:
        return f"{self.bucket_mib} MiB buckets, depth {self.depth}"


@dataclass
class Config:
    label: str
    records: list[RoundRecord]
    # The source agent's own round time (until every engine committed), per timed round.
    served: list[float] = field(default_factory=list)
    # With a holder: `fence()` right after each timed publish (the rest of the holder's
    # copy, which a trainer waits for only if it writes its tensors that soon).
    fences: list[float] = field(default_factory=list)
    first: float = 0.0  # the configuration's first publish() after its group is warm
    first_record: RoundRecord | None = None  # its traces: where a first round's time goes
    # With a holder: the rounds right after attach, while its host buffers were pinned.
    pinning: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(r.seconds for r in self.records)


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What a worker process needs to build the same tensors."""
    return {"preset": args.preset, "layers": args.layers}


def engine_args(layers: int | None) -> list[str]:
    return ENGINE_ARGS + ([] if layers is None else ["--layers", str(layers)])


def machine_lines(gpus: int) -> list[str]:
    """What the numbers were measured on: GPUs, driver, torch, CUDA, NCCL."""
    lines = [f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}"]
    lines.append(f"python {platform.python_version()}, torch {torch.__version__}")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(gpus)]
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        version = torch.cuda.nccl.version()
        nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        lines.append(
            f"GPUs: {gpus} x {names[0]} ({memory:.0f} GiB)"
            + ("" if len(set(names)) == 1 else f" (mixed: {names})")
        )
        lines.append(f"CUDA {torch.version.cuda}, NCCL {nccl}, driver {_driver()}")
        lines.append(f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    return lines


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def trainer_state(setup: Setup) -> dict[str, torch.Tensor]:
    """Llama-shaped bf16 tensors with cheap, non-constant contents on the trainer's device."""
    state = {}
    for i, meta in enumerate(state_dict_metas(preset(setup.preset, setup.layers), "bfloat16")):
        tensor = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=setup.devices[0])
        tensor.fill_((i % 97) / 97.0)
        state[meta.name] = tensor
    setup.sync()
    return state


def plan_for(
    setup: Setup,
    rank: int,
    pods: list[str],
    port: int,
    *,
    generation: int,
    shape: Shape,
    mode: SyncMode,
) -> MembershipPlan:
    return local_plan(
        pods,
        rank,
        generation=generation,
        port=port,
        backend=setup.backend,
        transfer=TransferOptions(
            bucket_size_bytes=shape.bucket_mib << 20,
            pipeline_depth=shape.depth,
            timeout_seconds=120,
        ),
        sync_name="bench",
        mode=mode,
        prewarm_timeout_seconds=120,
    )


def check_served(engines: list[Engine], version: int, result: PublishResult) -> None:
    if not result.ok:
        raise RuntimeError(f"round {version} failed: {result}")
    for engine in engines:
        if engine.health()["version"] != version:
            raise RuntimeError(f"engine {engine.port} does not serve {version}")


def start_engines_and_agents(
    st: Stack, setup: Setup, colocated: bool, agent_env: dict[str, str]
) -> tuple[AgentProc, list[AgentProc], list[Engine]]:
    engines, sinks = [], []
    trainer_device = setup.devices[0]
    if colocated:
        engine = st.start_engine("engine-0", preset=setup.preset, seed=0, device=trainer_device)
        engines.append(engine)
        source = st.start_agent(
            "source-0", role="source", device=trainer_device, engine=engine, extra_env=agent_env
        )
    else:
        tp = setup.engine_tp
        for i in range(1, len(setup.devices), tp):  # an engine on each group of tp GPUs
            device = setup.devices[i]
            engine = st.start_engine(
                f"engine-{i}", preset=setup.preset, seed=0, device=device, tp=tp
            )
            engines.append(engine)
            env = {**agent_env, "WEIGHTSYNC_ENGINE_DEVICES": str(tp)}
            sinks.append(
                st.start_agent(
                    f"sink-{i}", role="sink", device=device, engine=engine, extra_env=env
                )
            )
        source = st.start_agent(
            "source-0", role="source", device=trainer_device, extra_env=agent_env
        )
    st.wait_ready([source, *sinks], engines)
    return source, sinks, engines


def run_weightsync(
    args: argparse.Namespace,
    setup: Setup,
    state: dict[str, torch.Tensor],
    *,
    colocated: bool,
    http: bool = False,
    agent_env: dict[str, str] | None = None,
) -> tuple[list[Config], float | None]:
    """Rounds through real agents and engines, one group generation per bucket size.

    Returns each configuration's timed rounds and generation 1's pre-warm time. The first
    rounds of each configuration (new slots, new staging arenas in the engines, their
    mappings in the agents) are not timed.
    """
    flags = engine_args(setup.layers) + (["--update-socket", "none"] if http else [])
    st = Stack(Path(tempfile.mkdtemp(prefix="ws-bench-")), engine_args=flags)
    configs: list[Config] = []
    prewarm: float | None = None
    try:
        env = AGENT_ENV if agent_env is None else agent_env
        source, sinks, engines = start_engines_and_agents(st, setup, colocated, env)
        agents = [source, *sinks]
        pods = [a.proc.name for a in agents]
        port = free_port()
        mode = SyncMode.COLOCATED if colocated else SyncMode.DISAGGREGATED
        version = 0
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=600) as publisher:
            for generation, shape in enumerate(args.shapes, start=1):
                for rank, agent in enumerate(agents):
                    agent.put_plan(
                        plan_for(
                            setup,
                            rank,
                            pods,
                            port,
                            generation=generation,
                            shape=shape,
                            mode=mode,
                        )
                    )
                wait_warm(agents, generation, timeout=180)
                if generation == 1:
                    millis = source.status().generations[0].prewarm_millis
                    prewarm = None if millis is None else millis / 1000
                holding = "WEIGHTSYNC_HOLDER" not in env
                attach = timed_attach(publisher, state)
                # With a holder: rounds right after attach, its host buffers pinning beside
                # them, then the wait until both are registered (a trainer's first steps).
                pinning = [] if not holding else [
                    timed_round(publisher, state, engines, setup, version := version + 1)
                    for _ in range(PINNING_PROBE_ROUNDS)
                ]  # fmt: skip
                ready = wait_pinned(source, state) if holding else 0.0
                print(f"{shape.label()}: attach {attach:.4f} s, rounds while pinning"
                      f" {[round(p, 4) for p in pinning]}, holder ready"
                      f" {ready:.2f} s later")  # fmt: skip
                records: list[RoundRecord] = []
                served: list[float] = []
                fences: list[float] = []
                first = 0.0
                first_record: RoundRecord | None = None
                rep = 0
                while rep < args.reps + WARMUP_ROUNDS:
                    version += 1
                    setup.sync()
                    wall, started = time.time(), time.perf_counter()
                    result = publisher.publish(state, version=version)
                    elapsed = time.perf_counter() - started
                    if not first:
                        first = elapsed
                        if publisher.last_timings is not None:
                            first_record = RoundRecord(
                                version, elapsed, wall, publisher.last_timings
                            )
                    fenced = time.perf_counter()
                    publisher.fence()
                    fenced = time.perf_counter() - fenced
                    check_served(engines, version, result)
                    timings = publisher.last_timings
                    if holding:
                        _check_held(source, version)
                    if rep >= WARMUP_ROUNDS and timings is not None:
                        records.append(RoundRecord(version, elapsed, wall, timings))
                        served.append(result.duration_seconds)
                        fences.append(fenced)
                    rep += 1
                kind = ", HTTP hand-off" if http else ""
                configs.append(
                    Config(shape.label() + kind, records, served, fences, first, first_record,
                           pinning)
                )  # fmt: skip
        time.sleep(0.5)  # the sinks' last trace lines
        firsts = [c.first_record for c in configs if c.first_record is not None]
        attach_logs(
            [r for c in configs for r in c.records] + firsts,
            {a.proc.name: a.proc.log for a in agents},
            [e.proc.log for e in engines],
        )
    except BaseException:
        print(st.logs())
        raise
    finally:
        st.close()
    return configs, prewarm


def timed_attach(publisher: Publisher, state: dict[str, torch.Tensor]) -> float:
    """What a trainer does at start-up (`Publisher.attach`): the agent maps the tensors,
    plans the buckets and starts allocating its holder's buffers."""
    started = time.perf_counter()
    if not publisher.attach(state):
        raise RuntimeError("the source agent has no plan to attach to")
    return time.perf_counter() - started


def timed_round(
    publisher: Publisher,
    state: dict[str, torch.Tensor],
    engines: list[Engine],
    setup: Setup,
    version: int,
) -> float:
    setup.sync()
    started = time.perf_counter()
    result = publisher.publish(state, version=version)
    elapsed = time.perf_counter() - started
    publisher.fence()
    check_served(engines, version, result)
    return elapsed


def wait_pinned(source: AgentProc, state: dict[str, torch.Tensor]) -> float:
    """Seconds until the source's holder has both host buffers registered."""
    started = time.perf_counter()
    need = 2 * sum(t.nbytes for t in state.values())
    while holder_bytes(source) < need:
        _bound(int(time.perf_counter() - started), PINNING_SECONDS, "s pinning")
        time.sleep(0.1)
    return time.perf_counter() - started


def holder_bytes(agent: AgentProc) -> float:
    for line in agent.metrics().splitlines():
        if line.startswith("weightsync_holder_host_memory_bytes{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _check_held(source: AgentProc, version: int) -> None:
    if source.status().holding != version:
        raise RuntimeError(f"version {version} is not held once the buffers are pinned")


def _bound(count: int, most: int, what: str) -> None:
    if count > most:
        raise RuntimeError(f"more than {most} {what}")


def holder_rows(
    args: argparse.Namespace,
    setup: Setup,
    state: dict[str, torch.Tensor],
    nbytes: int,
    floor: float,
) -> list[Row]:
    """The rounds again with the source agent holding for P2P recovery, as it does by
    default (needs Mooncake): when publish() returns, when every engine serves, the
    fence right after (the rest of the holder's copy), and the first round."""
    if not args.holder:
        return []
    held, _ = run_weightsync(args, setup, state, colocated=False, agent_env={})
    print_breakdowns("source holding", held)
    if args.holder_ab:  # the same rounds with the held copy queueing through the votes
        through, _ = run_weightsync(
            args, setup, state, colocated=False, agent_env={THROUGH_VOTES: "true"}
        )
        for config in through:
            config.label += ", measuring only: held copy through the votes"
        print_breakdowns("source holding, held copy through the votes", through)
        held += through
    rows = []
    for config in held:
        walls = [round(r.seconds, 4) for r in config.records]
        print(
            f"holding {config.label}: publish {walls}, engines serve {config.served},"
            f" fence {[round(f, 4) for f in config.fences]}, first {config.first:.4f},"
            f" source votes ms {[source_votes_ms(r) for r in config.records]}"
        )
        slowest = max(config.records, key=lambda r: r.seconds)
        for line in breakdown(f"source holding, slowest round, {config.label}", slowest):
            print(line)
        rows += [
            Row(f"source holding, publish() returns, {config.label}", config.median,
                nbytes, floor),
            Row(f"source holding, every engine serves, {config.label}",
                statistics.median(config.served), nbytes, floor),
            Row(f"source holding, fence() right after publish(), {config.label}",
                statistics.median(config.fences), 0),
            Row(f"source holding, first publish() once its buffers are pinned, {config.label}",
                config.first, nbytes, config.median),
            Row(f"source holding, first publish() after attach, pinning beside, {config.label}",
                config.pinning[0], nbytes, config.median),
            Row(f"source holding, rounds 2-{PINNING_PROBE_ROUNDS} beside the pinning (median),"
                f" {config.label}", statistics.median(config.pinning[1:]), nbytes,
                config.median),
        ]  # fmt: skip
    return rows


def source_votes_ms(record: RoundRecord) -> float | None:
    """The source's two votes in one round (host time, ms): what the held copy's
    device-to-host queue used to stretch (issue #40)."""
    spans = (record.source or {}).get("spans", {})
    votes = [spans[name][1] for name in ("vote_transfer", "vote_commit") if name in spans]
    return round(sum(votes), 2) if votes else None


def run_naive(args: argparse.Namespace) -> float:
    st = Stack(Path(tempfile.mkdtemp(prefix="ws-naive-")), engine_args=engine_args(args.layers))
    try:
        engines = [
            st.start_engine(f"naive-engine-{i}", preset=args.preset, seed=0, device=f"cuda:{i}")
            for i in range(1, args.gpus)
        ]
        st.wait_ready([], engines)
        kwargs = {"version": 1, "engines": [e.url for e in engines], **model_kwargs(args)}
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


def d2d_floors(state: dict[str, torch.Tensor], reps: int) -> dict[str, float]:
    """Copying the state dict on one GPU, tensor by tensor: batched and one copy each."""
    sources = list(state.values())
    targets = [torch.empty_like(t) for t in sources]

    def batched() -> None:
        torch._foreach_copy_(targets, sources)

    def each() -> None:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)

    out = {}
    for name, copy in (("foreach", batched), ("copy_", each)):
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            started = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        out[name] = statistics.median(times[1:])
    targets.clear()
    torch.cuda.empty_cache()
    return out


def print_breakdowns(title: str, configs: list[Config]) -> None:
    for config in configs:
        print()
        median = median_record(config.records)
        for line in breakdown(f"{title}, median round, {config.label}", median):
            print(line)
        if config.first_record is not None:
            print()
            for line in breakdown(f"{title}, first round, {config.label}", config.first_record):
                print(line)


def smoke(args: argparse.Namespace) -> None:
    """The benchmark's machinery on CPU: stacks, rounds, logs, breakdown (no timing claims)."""
    setup = Setup("small", None, Backend.GLOO, ["cpu"] * args.gpus, args.engine_tp)
    state = trainer_state(setup)
    nbytes = sum(t.nbytes for t in state.values())
    configs, _ = run_weightsync(args, setup, state, colocated=False)
    colocated, _ = run_weightsync(args, setup, state, colocated=True)
    rows = [Row(f"weightsync publish(), {c.label}", c.median, nbytes) for c in configs]
    rows += holder_rows(args, setup, state, nbytes, 1.0)
    rows += [Row(f"colocated publish(), {c.label}", c.median, nbytes) for c in colocated]
    for row in rows:
        print(row.line())
    print_breakdowns("weightsync", configs)
    print_breakdowns("colocated", colocated)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument(
        "--configs",
        default="512x2,1024x2,512x3",
        help="bucket MiB x pipeline depth, comma-separated; the first is the headline",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--skip", action="append", default=[], choices=["naive", "colocated", "http"]
    )
    parser.add_argument(
        "--holder",
        action="store_true",
        help="also run with the source agent holding for P2P recovery (needs Mooncake)",
    )
    parser.add_argument(
        "--holder-ab",
        action="store_true",
        help="with --holder: the holding rounds again, the held copy not paused for the"
        " votes (measuring only)",
    )
    parser.add_argument("--preset", default="llama3-8b", choices=["llama3-8b", "qwen3-30b-a3b"])
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers")
    parser.add_argument("--smoke", action="store_true", help="CPU check of the bench itself")
    parser.add_argument(
        "--engine-tp", type=int, default=1, help="GPUs per engine (tensor-parallel workers)"
    )
    args = parser.parse_args()
    args.shapes = Shape.parse(args.configs)
    if args.smoke:
        args.gpus = args.gpus or 3
        args.shapes = [Shape(1, 2), Shape(4, 3)]
        smoke(args)
        return
    args.gpus = args.gpus or torch.cuda.device_count()
    if args.gpus < 1:
        raise SystemExit("needs a GPU")
    if args.engine_tp < 1 or (args.gpus - 1) % args.engine_tp:
        raise SystemExit(
            f"--engine-tp {args.engine_tp} does not divide {args.gpus - 1} engine GPUs"
        )
    devices = [f"cuda:{i}" for i in range(args.gpus)]
    setup = Setup(args.preset, args.layers, Backend.NCCL, devices, args.engine_tp)
    metas = state_dict_metas(preset(args.preset, args.layers), "bfloat16")
    nbytes = sum(m.nbytes for m in metas)
    for line in machine_lines(args.gpus):
        print(line)
    print(
        f"{args.preset}, {args.layers or 'all'} layers: {len(metas)} tensors, "
        f"{nbytes / 1e9:.2f} GB bf16; "
        f"1 trainer GPU -> {(args.gpus - 1) // args.engine_tp} engines of "
        f"{args.engine_tp} GPU(s); configurations: {args.configs}",
        flush=True,
    )
    if args.gpus == 1:  # one GPU: the Colocated rows only (trainer and engine share it)
        args.skip = sorted({*args.skip, "naive", "http"})
        state = trainer_state(setup)
        report(args, setup, state, nbytes=nbytes, floor=None, rows=[], configs=[])
        return

    sizes = sorted({shape.bucket_mib for shape in args.shapes})
    chunks = [mib << 20 for mib in sizes]
    raw = spawn_workers(
        raw_worker, args.gpus, {"reps": args.reps, "chunks": chunks, **model_kwargs(args)}
    )
    print({k: round(v, 4) for k, v in raw.items()}, flush=True)
    floor = raw["floor"]
    rows = [
        Row("NCCL broadcast, tensor by tensor (floor)", floor, nbytes),
        *(
            Row(
                f"NCCL broadcast of one buffer in {mib} MiB chunks",
                raw[f"chunked_{c}"],
                nbytes,
                floor,
            )
            for mib, c in zip(sizes, chunks, strict=True)
        ),
        Row("first broadcast, cold communicator", raw["cold_first"], nbytes, floor),
        Row("pre-warm (barrier + small broadcast)", raw["prewarm"], 0),
        Row("first broadcast after pre-warm", raw["warm_first"], nbytes, floor),
    ]

    state = trainer_state(setup)
    configs, agent_prewarm = run_weightsync(args, setup, state, colocated=False)
    rows += weightsync_rows(
        args, setup, state, nbytes=nbytes, floor=floor, configs=configs, agent_prewarm=agent_prewarm
    )
    buffer_floor = min(raw[f"chunked_{c}"] for c in chunks)
    report(
        args,
        setup,
        state,
        nbytes=nbytes,
        floor=floor,
        rows=rows,
        configs=configs,
        buffer_floor=buffer_floor,
    )


def weightsync_rows(
    args: argparse.Namespace,
    setup: Setup,
    state: dict[str, torch.Tensor],
    *,
    nbytes: int,
    floor: float,
    configs: list[Config],
    agent_prewarm: float | None,
) -> list[Row]:
    """The disaggregated rows: publish() per configuration, HTTP, holders, naive."""
    rows: list[Row] = []
    print_breakdowns("weightsync", configs)
    for config in configs:
        print(f"weightsync {config.label}: {[round(r.seconds, 4) for r in config.records]}")
        rows.append(
            Row(
                f"weightsync publish() -> engines serve, {config.label}",
                config.median,
                nbytes,
                floor,
            )
        )
        rows.append(Row(f"  first publish() after attach, {config.label}", config.first,
                        nbytes, config.median))  # fmt: skip
    if agent_prewarm is not None:
        rows.append(Row("agent pre-warm of generation 1", agent_prewarm, 0))
    http: list[Config] = []
    if "http" not in args.skip:
        http_args = argparse.Namespace(**{**vars(args), "shapes": args.shapes[:1]})
        http, _ = run_weightsync(http_args, setup, state, colocated=False, http=True)
        print_breakdowns("weightsync", http)
        rows += [
            Row(f"weightsync publish() -> engines serve, {c.label}", c.median, nbytes, floor)
            for c in http
        ]
    rows += holder_rows(args, setup, state, nbytes, floor)
    if "naive" not in args.skip:
        rows.append(
            Row("naive: broadcast + HTTP engine request per tensor", run_naive(args), nbytes, floor)
        )
    return rows


def report(
    args: argparse.Namespace,
    setup: Setup,
    state: dict[str, torch.Tensor],
    *,
    nbytes: int,
    floor: float | None,
    rows: list[Row],
    configs: list[Config],
    buffer_floor: float | None = None,
) -> None:
    """The Colocated rows (one GPU), then every row and each target's verdict.

    Disaggregated rounds are held to both floors: tensor by tensor (what a trainer's own
    loop of broadcasts costs) and one buffer (the wire alone, the stricter one where
    tensors are many and small)."""
    colocated: list[Config] = []
    d2d: float | None = None
    if "colocated" not in args.skip:
        copies = d2d_floors(state, args.reps)
        d2d = min(copies.values())
        best = "copy_" if copies["copy_"] <= copies["foreach"] else "_foreach_copy_"
        rows.append(Row(f"D2D copy on one GPU (colocated floor; {best})", d2d, nbytes))
        rows.append(
            Row("  D2D copy, one _foreach_copy_ of every tensor", copies["foreach"], nbytes, d2d)
        )
        rows.append(Row("  D2D copy, one copy_ per tensor", copies["copy_"], nbytes, d2d))
        colocated, _ = run_weightsync(args, setup, state, colocated=True)
        if args.holder:  # as installed: the source holds (it reloads a restarted engine)
            held, _ = run_weightsync(args, setup, state, colocated=True, agent_env={})
            for config in held:
                config.label += ", source holding"
            colocated += held
        print_breakdowns("colocated", colocated)
        for config in colocated:
            print(f"colocated {config.label}: {[round(r.seconds, 4) for r in config.records]}")
            rows.append(
                Row(
                    f"colocated publish() -> engine serves, {config.label}",
                    config.median,
                    nbytes,
                    d2d,
                )
            )
    print()
    for row in rows:
        print(row.line())
    print()
    for config in configs:
        assert floor is not None
        assert buffer_floor is not None
        for name, base in (("tensor-by-tensor", floor), ("one-buffer", buffer_floor)):
            ratio = config.median / base
            verdict = "met" if ratio <= DISAGGREGATED_TARGET else "missed"
            print(
                f"target publish <= {DISAGGREGATED_TARGET}x {name} floor, {config.label}:"
                f" {ratio:.2f}x {verdict}"
            )
    for config in colocated:
        assert d2d is not None
        ratio = config.median / d2d
        verdict = "met" if ratio <= COLOCATED_TARGET else "missed"
        print(
            f"target colocated <= {COLOCATED_TARGET}x D2D, {config.label}: {ratio:.2f}x {verdict}"
        )


if __name__ == "__main__":
    main()
