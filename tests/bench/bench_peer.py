"""checkpoint-engine side by side with weightsync: the same GPUs, run and state dict.

    python -m tests.bench.bench_peer [--gpus N] [--preset llama3-8b|qwen3-30b-a3b]
                                     [--layers N] [--bucket-mib 1024] [--depth 2]
                                     [--reps 5] [--skip kept|auto_pg|weightsync] [--p2p]

Both start where a trainer is: its bf16 tensors on GPU 0 (the tensors of
`bench_broadcast.trainer_state`). GPUs 1.. are engine GPUs, one engine each. Both end
when every engine holds the new weights.

checkpoint-engine (the installed version, printed): its `ParameterServer`, one process
per GPU (`peer_workers`), in broadcast mode; on each GPU one receiver process that holds
the model's weights and loads through checkpoint-engine's `update_weights_from_ipc`.
checkpoint-engine reads host memory, so its time includes the trainer's copy to host
(`register_checkpoint` from the trainer's GPU tensors into its shared pinned pool,
reused from one version to the next); every total is also given without it. Per
version: register_checkpoint, gather_metas, update, as its own example calls them.
* kept:    `auto_pg=False`, one process group for every update;
* auto_pg: `auto_pg=True` (its documented recommendation): a process group per update;
* `--p2p`: `update(ranks=[1..])`, each engine GPU reading from the trainer's pinned pool
           over its Mooncake P2P store (needs RDMA NICs; reported as not run if it fails).
Mooncake stays hidden from the broadcast runs: they need no P2P store (checkpoint-engine
installed without its `p2p` extra), and one that cannot start fails `ParameterServer()`.
`LOGURU_LEVEL=INFO` shows checkpoint-engine's own log lines (bucket size and all).

weightsync, after the peer's processes have exited: `bench_broadcast.run_weightsync` in
the default configuration (source agent holding for P2P recovery, needs Mooncake; bucket
size `--bucket-mib`, pipeline depth `--depth`): publish() (the trainer's blocked time, the
holder's copy to host included) and the agent's round until every engine serves
(`PublishResult.duration_seconds`). The ratio column is checkpoint-engine / weightsync.

What the GPU machine needs beside torch (no network there: wheels for Python 3.12,
manylinux x86_64, installed with `pip install --no-deps --target DIR` and DIR put ahead
of the image's site-packages, where an older pydantic may be):
    checkpoint-engine==0.4.2, pyzmq==27.3.0, loguru==0.7.3, fastapi==0.115.14
    (a newer one needs opentelemetry-api), starlette==0.46.2, pydantic==2.14.3,
    pydantic-core==2.50.4, typing-extensions==4.16.0, annotated-types==0.8.0,
    typing-inspection==0.4.5, mooncake-transfer-engine-non-cuda==0.3.13.post1
and Debian's libibverbs1, libnl-3-200, libnl-route-3-200 and libnuma1 (Mooncake links
them). checkpoint-engine also imports httpx, safetensors and numpy (CUDA images carry them).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before NCCL loads, as bench_broadcast

import statistics
from dataclasses import dataclass, field
from importlib.metadata import version as package_version

import torch

from tests.bench.bench_broadcast import (
    WARMUP_ROUNDS,
    Row,
    Setup,
    Shape,
    machine_lines,
    print_breakdowns,
    run_weightsync,
    trainer_state,
)
from tests.bench.peer_workers import PHASES, run_peer
from weightsync.api.control import Backend, TransferOptions
from weightsync.reference.model import preset, state_dict_metas

TARGET = 5.0  # checkpoint-engine's time over weightsync's, from the same starting point
MODES = {"kept": "broadcast, kept pg", "auto_pg": "broadcast, auto_pg", "p2p": "P2P, kept pg"}


@dataclass
class Peer:
    """One mode's timed repetitions, seconds per phase (`peer_workers.PHASES`)."""

    mode: str
    times: dict[str, list[float]]
    rows: list[Row] = field(default_factory=list)  # printed once measured

    def median(self, phase: str) -> float:
        return statistics.median(self.times[phase])

    def total(self, *, copy_to_host: bool) -> float:
        phases = PHASES if copy_to_host else PHASES[1:]
        return statistics.median(map(sum, zip(*(self.times[p] for p in phases), strict=True)))

    def measured(self, nbytes: int) -> None:
        label = f"checkpoint-engine {self.mode}"
        self.rows = [
            Row(f"{label}: copy to host (register)", self.median("register"), nbytes),
            Row("  gather_metas", self.median("gather"), 0),
            Row("  update() until every receiver loaded", self.median("update"), nbytes),
            Row(f"{label}: total", self.total(copy_to_host=True), nbytes),
            Row(f"{label}: total, no copy to host", self.total(copy_to_host=False), nbytes),
        ]


@dataclass
class Ours:
    publish: float  # publish() returns: the trainer's blocked time
    served: float  # the source agent's round: until every engine serves
    rows: list[Row]


def run_peers(args: argparse.Namespace, nbytes: int) -> list[Peer]:
    kwargs = {
        "preset": args.preset,
        "layers": args.layers,
        "reps": args.reps,
        "warmup": WARMUP_ROUNDS,
    }
    modes = [m for m in ("kept", "auto_pg") if m not in args.skip] + (["p2p"] if args.p2p else [])
    peers = []
    for mode in modes:
        try:
            times = run_peer(mode, args.gpus, kwargs, args.timeout)
        except (RuntimeError, TimeoutError) as error:
            if mode != "p2p":
                raise
            reason = str(error).strip().splitlines()[-1]
            print(f"checkpoint-engine P2P did not run: {reason}", flush=True)
            continue
        peer = Peer(mode, times)
        for phase in PHASES:
            print(f"{mode} {phase}: {[round(t, 4) for t in times[phase]]}", flush=True)
        peer.measured(nbytes)  # printed now: a cut-off run keeps them
        peers.append(peer)
    return peers


def run_ours(args: argparse.Namespace, nbytes: int) -> Ours:
    setup = Setup(args.preset, args.layers, Backend.NCCL, [f"cuda:{i}" for i in range(args.gpus)])
    state = trainer_state(setup)
    shape = Shape(args.bucket_mib, args.depth)
    rounds = argparse.Namespace(shapes=[shape], reps=args.reps)
    (config,), _ = run_weightsync(rounds, setup, state, colocated=False, agent_env={})
    print_breakdowns("weightsync, holder on", [config])
    print(f"weightsync publish(): {[round(r.seconds, 4) for r in config.records]}")
    print(f"weightsync every engine serves: {[round(s, 4) for s in config.served]}", flush=True)
    publish, served = config.median, statistics.median(config.served)
    rows = [
        Row("weightsync publish() returns (holder on)", publish, nbytes),
        Row("weightsync until every engine serves (holder on)", served, nbytes),
    ]
    return Ours(publish, served, rows)


def report(peers: list[Peer], ours: Ours | None) -> None:
    """Every row again, then checkpoint-engine's totals over weightsync's two times."""
    print()
    for row in [row for peer in peers for row in peer.rows] + (ours.rows if ours else []):
        print(row.line())
    if ours is None:
        return
    print(f"\n{'checkpoint-engine / weightsync':<52} {'publish()':>10} {'engines serve':>14}")
    for peer in peers:
        for copy in (True, False):
            total = peer.total(copy_to_host=copy)
            what = MODES[peer.mode] + ("" if copy else ", without copy to host")
            print(f"  {what:<50} {total / ours.publish:9.2f}x {total / ours.served:13.2f}x")
    print()
    for peer in peers:
        ratio = peer.total(copy_to_host=True) / ours.publish
        verdict = "met" if ratio >= TARGET else "missed"
        print(
            f"target checkpoint-engine ({MODES[peer.mode]}, with its copy to host) >= "
            f"{TARGET}x weightsync publish(): {ratio:.2f}x {verdict}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPU 0 trains, the rest serve")
    parser.add_argument("--preset", default="llama3-8b", choices=["llama3-8b", "qwen3-30b-a3b"])
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers")
    parser.add_argument("--bucket-mib", type=int, default=1024, help="weightsync's bucket size")
    parser.add_argument("--depth", type=int, default=TransferOptions().pipeline_depth)
    parser.add_argument("--reps", type=int, default=5, help="timed, after 2 untimed")
    parser.add_argument(
        "--skip", action="append", default=[], choices=["kept", "auto_pg", "weightsync"]
    )
    parser.add_argument("--p2p", action="store_true", help="also checkpoint-engine's P2P mode")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per peer mode")
    args = parser.parse_args()
    args.gpus = args.gpus or torch.cuda.device_count()
    if args.gpus < 2:
        raise SystemExit("needs 2 or more GPUs: the trainer's and an engine's")
    metas = state_dict_metas(preset(args.preset, args.layers), "bfloat16")
    nbytes = sum(m.nbytes for m in metas)
    for line in machine_lines(args.gpus):
        print(line)
    label = f"holder on, {Shape(args.bucket_mib, args.depth).label()}"
    print(
        f"checkpoint-engine {package_version('checkpoint-engine')} against weightsync "
        f"({label}); {args.preset}, {args.layers or 'all'} layers: {len(metas)} tensors, "
        f"{nbytes / 1e9:.2f} GB bf16; 1 trainer GPU -> {args.gpus - 1} engines",
        flush=True,
    )
    peers = run_peers(args, nbytes)  # first: its processes exit before weightsync starts
    ours = None if "weightsync" in args.skip else run_ours(args, nbytes)
    report(peers, ours)


if __name__ == "__main__":
    main()
