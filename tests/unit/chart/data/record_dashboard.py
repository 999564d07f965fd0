"""Regenerate `dashboard_recording.json`, the recorded range queries the render test draws.

Real metric objects (the agents' `AgentMetrics`, the operator's module), served over
HTTP, scraped by a real Prometheus (tests.e2e.prometheus), queried panel by panel by
docs/scripts/render_dashboard.py. Only the rounds are simulated: one source and three
sinks of WeightSync rl/tiny publish a 16 GB version every few seconds; engine-2 restarts,
fails one P2P pull, recovers the current version from a holder and rejoins; a burst of
timeouts fails some rounds.

    python -m tests.unit.chart.data.record_dashboard [--minutes 6]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from docs.scripts import render_dashboard
from prometheus_client import start_http_server
from tests.e2e.prometheus import Prometheus, agent_job, agent_target, operator_job

from weightsync.agent.metrics import AgentMetrics
from weightsync.controller import metrics as operator_metrics

HERE = Path(__file__).parent
MODEL_BYTES = 16_060_000_000
TICK_SECONDS = 3.0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=6.0)
    args = parser.parse_args()
    rng = random.Random(7)
    agents = {
        "trainer-0": AgentMetrics("source"),
        **{f"engine-{i}": AgentMetrics("sink") for i in range(3)},
    }
    targets = []
    for pod, metrics in agents.items():
        port = free_port()
        start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
        targets.append(
            agent_target(f"127.0.0.1:{port}", namespace="rl", pod=pod, weightsync="tiny")
        )
    operator_port = free_port()
    operator_metrics.serve(operator_port, host="127.0.0.1")
    jobs = [agent_job(targets), operator_job([f"127.0.0.1:{operator_port}"])]

    with tempfile.TemporaryDirectory() as workdir, Prometheus(Path(workdir), jobs) as prometheus:
        prometheus.wait_targets_up()
        began = time.time()
        version, generation = 0, 1
        for metrics in agents.values():
            metrics.prewarm_duration.observe(rng.uniform(0.6, 1.2))
        restarted_at, rejoined_at = began + 0.45 * 60 * args.minutes, None
        failed_pull = False
        while (now := time.time()) < began + 60 * args.minutes:
            version += 1
            failing = 0.7 < (now - began) / (60 * args.minutes) < 0.75
            members = [p for p in agents if not (restarted_at <= now and rejoined_at is None)
                       or p != "engine-2"]  # fmt: skip
            for pod in members:
                metrics = agents[pod]
                duration = rng.uniform(0.05, 0.09) + (0.02 if pod != "trainer-0" else 0)
                if failing:
                    metrics.round_failed(30.0, "timeout")
                else:
                    metrics.round_succeeded(duration, MODEL_BYTES, version)
            if restarted_at <= now and rejoined_at is None:
                restarted = agents["engine-2"]
                if not failed_pull:
                    restarted.current_version.set(-1)
                    if now > restarted_at + 15:
                        restarted.recovery_failed("holders_gone")
                        failed_pull = True
                elif now > restarted_at + 40:
                    rejoined_at = now
                    generation += 1
                    restarted.recovery_succeeded(rng.uniform(18, 24), MODEL_BYTES, version - 1)
                    for metrics in agents.values():
                        metrics.prewarm_duration.observe(rng.uniform(0.8, 1.6))
            operator_metrics.CURRENT_VERSION.labels("rl", "tiny").set(version - failing)
            operator_metrics.GROUP_GENERATION.labels("rl", "tiny").set(generation)
            result = "waiting" if (restarted_at <= now and rejoined_at is None) else "ok"
            operator_metrics.RECONCILES.labels(result).inc()
            time.sleep(TICK_SECONDS)
        time.sleep(3)
        end = time.time()
        dashboard = json.loads(render_dashboard.DASHBOARD.read_text())
        recording = render_dashboard.record(
            dashboard, prometheus.url, start=began, end=end, step=5.0, variables={}
        )
    out = HERE / "dashboard_recording.json"
    out.write_text(json.dumps(recording, separators=(",", ":")) + "\n")
    print(out)


if __name__ == "__main__":
    main()
