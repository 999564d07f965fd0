"""P2P recovery benchmark: pulls from a holder agent vs raw transfer-engine reads.

    python -m tests.bench.bench_p2p [--preset small] [--dtype float32] [--bucket-mib 16]
                                    [--reps 5] [--protocol tcp|rdma]

One run, on one machine, the same bytes each time:
* holder: a real source agent (its transfer engine on 127.0.0.61) holds the version a
  Publisher round just committed;
* raw:    this process reads the holder's registered region with the Mooncake transfer
  engine directly: bucket-sized synchronous reads in order, one thread, no checksum,
  into one registered buffer (the transport's own speed from this holder);
* pull:   weightsync's recovery data path (`bucket_pull.pull_buckets`) in this process:
  holders agreed by `choose_holders`, bucket by bucket into two slots, every bucket's
  CRC-32 verified, no engine (excluding engine load);
* recover: a real sink agent and reference engine, `POST /v1/recover` to `done`, as the
  operator drives it (including engine load); its bandwidth is the agent's own report.
Each repetition publishes a new version first (the engine only takes newer ones), then
measures the three in turn; the table shows medians. The ratio is to raw (target: the
pull at >= 0.80 of raw).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import tempfile
import time
from importlib.metadata import version as package_version
from pathlib import Path

import torch

from tests.integration.stack import AgentProc, Stack, free_port, http_json, wait_warm
from tests.support.eventually import eventually
from tests.support.plans import local_plan
from weightsync.agent.bucket_pull import pull_buckets
from weightsync.agent.recovery import choose_holders
from weightsync.api.control import (
    Backend,
    Holding,
    MembershipPlan,
    RecoverRequest,
    RecoveryState,
    RecoveryStatus,
    TransferOptions,
)
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.client import Publisher
from weightsync.reference.model import PRESETS, build_model, randomize
from weightsync.transfer.buffers import torch_dtype
from weightsync.transfer.held import held_offsets
from weightsync.transfer.layout import BucketLayout
from weightsync.transfer.p2p import Endpoints, HeldRegion

TARGET = 0.80
HOLDER_HOST, BENCH_HOST, SINK_HOST = "127.0.0.61", "127.0.0.62", "127.0.0.63"


def machine_lines() -> list[str]:
    return [
        f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"{platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
        f"torch {torch.__version__}, mooncake-transfer-engine "
        f"{package_version('mooncake-transfer-engine-non-cuda')}",
    ]


def holder_plan(port: int, bucket_bytes: int) -> MembershipPlan:
    """A group of the source alone: its rounds only stage the holder's copy."""
    return local_plan(
        ["holder-0"],
        0,
        generation=1,
        port=port,
        backend=Backend.GLOO,
        transfer=TransferOptions(bucket_size_bytes=bucket_bytes, timeout_seconds=120.0),
        sync_name="bench-p2p",
        prewarm_timeout_seconds=120.0,
    )


def holding_of(agent: AgentProc) -> Holding:
    return Holding.model_validate(http_json("GET", f"{agent.url}/v1/holding", None, agent.token))


def publish_and_hold(
    publisher: Publisher, trainer: torch.nn.Module, version: int, holder: AgentProc
) -> Holding:
    result = publisher.publish(trainer.named_parameters(), version=version)
    if not result.ok:
        raise SystemExit(f"the holder's round failed: {result}")
    return holding_of(holder)


def raw_read(endpoints: Endpoints, protocol: RecoveryProtocol, holding: Holding) -> float:
    """Seconds to read the held region bucket by bucket, straight through the engine."""
    endpoint = endpoints.get(protocol)
    layout = BucketLayout.from_json(holding.layout)
    target = torch.empty(holding.nbytes, dtype=torch.uint8)
    endpoint.register(target)
    started = time.perf_counter()
    for bucket, offset in zip(layout.buckets, held_offsets(layout), strict=True):
        endpoint.read(
            holding.segment, target.data_ptr() + offset, holding.address + offset, bucket.nbytes
        )
    seconds = time.perf_counter() - started
    endpoint.unregister(target)
    return seconds


def weightsync_pull(
    endpoints: Endpoints, protocol: RecoveryProtocol, holder: AgentProc, holding: Holding
) -> float:
    """Seconds for the recovery's pull path (agreement, 2 slots, checksums), no engine."""
    request = RecoverRequest(
        version=holding.version,
        lineage=holding.lineage,
        holders=[holder.url],
        protocol=holding.protocol,
    )
    agreement = choose_holders(request, [holder.url], {holder.url: holding})
    layout = agreement.layout
    slots = [torch.empty(layout.capacity_bytes, dtype=torch.uint8) for _ in range(2)]
    regions = [HeldRegion(url, h.segment, h.address, h.nbytes) for url, h in agreement.holders]
    started = time.perf_counter()
    summary = asyncio.run(
        pull_buckets(
            endpoints.get(protocol),
            regions,
            layout,
            agreement.checksums,
            slots,
            deadline=time.monotonic() + 600,
        )
    )
    seconds = time.perf_counter() - started
    if summary.bytes != layout.total_bytes:
        raise SystemExit(f"pulled {summary.bytes} of {layout.total_bytes} B")
    return seconds


def recover(sink: AgentProc, holder: AgentProc, version: int, protocol: str) -> RecoveryStatus:
    request = RecoverRequest(
        version=version, holders=[holder.url], protocol=RecoveryProtocol(protocol.upper())
    )
    http_json("POST", f"{sink.url}/v1/recover", request.model_dump_json(), sink.token)

    def finished() -> RecoveryStatus | None:
        status = sink.status().recovery
        done = (RecoveryState.DONE, RecoveryState.FAILED)
        return status if status is not None and status.state in done else None

    status = eventually(finished, timeout=600, interval=0.02, message="recovery over")
    if status.state != RecoveryState.DONE:
        raise SystemExit(f"recovery failed: {status}")
    return status


def line(name: str, seconds: float, nbytes: int, raw: float | None) -> str:
    rate = nbytes / seconds / 2**30 if seconds > 0 else float("nan")
    ratio = f"{raw / seconds:6.2f} of raw" if raw else ""
    return f"{name:<62} {seconds * 1000:9.1f} ms {rate:7.3f} GiB/s  {ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    args = parser.parse_args()
    protocol = RecoveryProtocol(args.protocol.upper())
    for text in machine_lines():
        print(text)

    p2p = {"WEIGHTSYNC_P2P_PROTOCOL": args.protocol}
    st = Stack(
        Path(tempfile.mkdtemp(prefix="ws-bench-p2p-")),
        engine_args=["--dtype", args.dtype, "--no-init"],
    )
    endpoints = Endpoints(lambda: BENCH_HOST)
    raws: list[float] = []
    pulls: list[float] = []
    recoveries: list[RecoveryStatus] = []
    try:
        holder = st.start_agent(
            "holder-0",
            role="source",
            device="cpu",
            extra_env={**p2p, "WEIGHTSYNC_P2P_HOST": HOLDER_HOST},
        )
        engine = st.start_engine("engine-1", preset=args.preset, seed=0, device="cpu")
        sink = st.start_agent(
            "sink-1",
            role="sink",
            device="cpu",
            engine=engine,
            extra_env={**p2p, "WEIGHTSYNC_P2P_HOST": SINK_HOST},
        )
        st.wait_ready([holder, sink], [engine])
        holder.put_plan(holder_plan(free_port(), args.bucket_mib << 20))
        wait_warm([holder], 1, timeout=60)
        trainer = build_model(
            PRESETS[args.preset], seed=None, dtype=torch_dtype(args.dtype), device="cpu"
        )
        assert holder.socket_path is not None
        with Publisher(holder.socket_path, timeout=600) as publisher:
            for rep in range(args.reps + 1):  # rep 0 allocates everywhere: not counted
                version = rep + 1
                randomize(trainer, seed=version)
                holding = publish_and_hold(publisher, trainer, version, holder)
                raw = raw_read(endpoints, protocol, holding)
                pulled = weightsync_pull(endpoints, protocol, holder, holding)
                status = recover(sink, holder, version, args.protocol)
                if rep:
                    raws.append(raw)
                    pulls.append(pulled)
                    recoveries.append(status)
                print(
                    f"rep {rep}: raw {raw * 1000:.1f} ms, pull {pulled * 1000:.1f} ms, "
                    f"recover {status.duration_millis} ms",
                    flush=True,
                )
    except BaseException:
        print(st.logs())
        raise
    finally:
        st.close()
        endpoints.close()

    nbytes = holding.nbytes
    layout_buckets = len(holding.checksums)
    print(
        f"\n{args.preset} {args.dtype}: {nbytes / 2**20:.1f} MiB in {layout_buckets} buckets of "
        f"<= {args.bucket_mib} MiB; Mooncake {args.protocol}, holder {HOLDER_HOST} -> "
        f"{BENCH_HOST} (raw, pull) / {SINK_HOST} (recover); median of {args.reps}"
    )
    raw = statistics.median(raws)
    pull_s = statistics.median(pulls)
    recover_s = statistics.median(r.duration_millis for r in recoveries) / 1000
    print(line("raw transfer-engine reads (floor)", raw, nbytes, None))
    print(line("weightsync pull path: checksums, 2 slots (excl. engine load)", pull_s, nbytes, raw))
    print(line("weightsync POST /v1/recover to done (incl. engine load)", recover_s, nbytes, raw))
    reported = statistics.median(r.bandwidth_bytes_per_second for r in recoveries)
    print(f"recover: agent-reported bandwidth {reported / 2**30:.3f} GiB/s (median)")
    verdict = "meets" if raw / pull_s >= TARGET else "misses"
    print(f"pull path at {raw / pull_s:.2f} of raw: {verdict} the {TARGET:.2f} target")


if __name__ == "__main__":
    main()
