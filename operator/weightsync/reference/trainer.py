"""A tiny trainer for tests and the demo: the reference model, real optimizer steps, Publisher.

    python -m weightsync.reference.trainer --preset tiny --interval 5
    python -m weightsync.reference.trainer --host $(POD_IP) --port 8080 --interval 0
    python -m weightsync.reference.trainer --world-size 2 --rank 1 --master-addr ...
    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m weightsync.reference.trainer --port 8080 ...   # two ranks in one pod

With `--world-size` above 1 it is a sharded trainer: one process per rank (gloo on CPU),
the model sharded by FSDP2 (`fully_shard`), and every rank publishes its own shards
(`sourceRanks` lists them all). Rank 0 runs the schedule and the HTTP endpoint and tells
the other ranks what to do (a step, or the digests of the full weights) by a broadcast.

Each step is one AdamW step on next-token prediction over random tokens (the numbers
do not matter, the weights change like a trainer's do), followed by
`Publisher().publish(model.named_parameters(), version=step)`. Steps run every
`--interval` seconds, or, with `--port`, also when someone POSTs `/step` (the answer is
the publish result as JSON), so a test decides exactly when rounds happen. `GET /status`
answers the last step and its result; `GET /digest` the weights' digests, in the shape
of the reference engine's `/v1/weights/digest`, so a test can prove engines bit-identical.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from weightsync.client import Publisher, PublisherError, PublishResult
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import PRESETS, LlamaForCausalLM, build_model

log = logging.getLogger("weightsync.trainer")


@dataclass(frozen=True, slots=True)
class StepReport:
    version: int
    ok: bool
    reason: str = ""
    message: str = ""
    generation: int | None = None
    duration_seconds: float = 0.0
    bytes: int = 0
    # The Publisher's lineage: a restarted trainer starts a new one, and its versions
    # count from 1 again (the WeightSync's status.lineage says which one it serves).
    lineage: str = ""


class Trainer:
    """One model, one optimizer, one Publisher; `step()` is serialised. With a process
    group of several ranks, the model is sharded with FSDP2 and every rank must call
    `step()` and `digests()` together (they are collectives)."""

    def __init__(self, preset: str, seed: int, lr: float, publish_timeout: float) -> None:
        torch.manual_seed(seed)
        self.model: LlamaForCausalLM = build_model(PRESETS[preset], seed).train()
        self.model.requires_grad_(True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.publisher = Publisher(timeout=publish_timeout)
        self.version = 0
        self.last: StepReport | None = None
        self._lock = threading.Lock()
        self._batch = (4, 16)

    def _optimizer_step(self) -> None:
        vocab = self.model.config.vocab_size
        tokens = torch.randint(0, vocab, (self._batch[0], self._batch[1] + 1))
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()

    def step(self) -> StepReport:
        with self._lock:
            self._optimizer_step()
            self.version += 1
            try:
                with torch.no_grad():
                    result: PublishResult = self.publisher.publish(
                        self.model.named_parameters(), version=self.version
                    )
            except PublisherError as error:
                report = StepReport(
                    self.version, False, error.reason, str(error), lineage=self.publisher.lineage
                )
            else:
                report = StepReport(
                    result.version,
                    result.ok,
                    result.reason,
                    result.message,
                    result.generation,
                    result.duration_seconds,
                    result.bytes,
                    self.publisher.lineage,
                )
            self.last = report
            log.info("step %d published: %s", self.version, report)
            return report

    def digests(self) -> dict[str, Any]:
        """The weights' digests, comparable with an engine's `/v1/weights/digest` (of the
        full tensors: gathered from every rank when sharded)."""
        with self._lock, torch.no_grad():
            tensors = {
                name: tensor_digest(p.full_tensor() if isinstance(p, DTensor) else p)
                for name, p in self.model.named_parameters()
            }
            return {"version": self.version, "tensors": tensors}


class Ranks:
    """Rank 0 tells every rank what to run next; each call runs on all ranks together.

    Rank 0's callers (the HTTP endpoint, the schedule) go through `run`, one at a time; the
    other ranks sit in `follow` until told to stop. A broadcast carries each command."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._lock = threading.Lock()

    def _execute(self, command: str) -> Any:
        return self.trainer.step() if command == "step" else self.trainer.digests()

    def run(self, command: str) -> Any:
        with self._lock:
            dist.broadcast_object_list([command], src=0)
            return self._execute(command)

    def follow(self) -> None:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            self._execute(box[0])


def _handler(trainer: Trainer, ranks: Ranks | None, lead: bool) -> type[BaseHTTPRequestHandler]:
    """Rank 0's (`lead`) endpoint runs steps; another rank's only answers `GET /status`
    (its readiness: it has joined the job)."""

    def step() -> StepReport:
        return ranks.run("step") if ranks is not None else trainer.step()

    def digests() -> dict[str, Any]:
        return ranks.run("digests") if ranks is not None else trainer.digests()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: dict[str, Any]) -> None:
            payload = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            if self.path != "/step" or not lead:
                self.send_error(404 if lead else 409, "rank 0 runs the steps")
                return
            self._reply(asdict(step()))

        def do_GET(self) -> None:
            if self.path == "/digest" and lead:
                self._reply(digests())
                return
            if self.path != "/status":
                self.send_error(404)
                return
            last = asdict(trainer.last) if trainer.last else None
            self._reply({"version": trainer.version, "last": last})

        def log_message(self, *args: object) -> None:
            return

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="weightsync reference trainer")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds; 0: only on /step")
    parser.add_argument("--host", default="127.0.0.1", help="address of the /step endpoint")
    parser.add_argument("--port", type=int, default=0, help="0: no /step endpoint")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--publish-timeout", type=float, default=120.0)
    parser.add_argument("--world-size", type=int, default=1, help="trainer ranks (processes)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address")
    parser.add_argument("--master-port", type=int, default=29400)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    ranks = None
    # Under torchrun (several ranks in one pod), its environment names the rank and the
    # rendezvous; only local rank 0 serves the /step endpoint on the pod's address.
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if launched else 0
    if launched:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", timeout=timedelta(days=1))
        log.info("rank %d of %d joined (torchrun)", args.rank, args.world_size)
    elif args.world_size > 1:
        # Rank 0 hosts the store; the others find it at --master-addr. Between steps the
        # other ranks wait in a broadcast for as long as the schedule says: a long timeout.
        store = TCPStore(
            "0.0.0.0" if args.rank == 0 else args.master_addr,  # noqa: S104 - rank 0 listens
            args.master_port,
            args.world_size,
            is_master=args.rank == 0,
            timeout=timedelta(minutes=10),
        )
        dist.init_process_group(
            "gloo", store=store, rank=args.rank, world_size=args.world_size,
            timeout=timedelta(days=1),
        )  # fmt: skip
        log.info("rank %d of %d joined", args.rank, args.world_size)
    trainer = Trainer(args.preset, args.seed, args.lr, args.publish_timeout)
    if args.world_size > 1:
        ranks = Ranks(trainer)
    if args.port and local_rank == 0:
        handler = _handler(trainer, ranks, lead=args.rank == 0)
        server = ThreadingHTTPServer((args.host, args.port), handler)
        threading.Thread(target=server.serve_forever, daemon=True, name="step-endpoint").start()
        log.info("POST http://%s:%d/step runs a step", args.host, args.port)
    if ranks is not None and args.rank != 0:
        ranks.follow()
        return
    stop = threading.Event()
    if args.interval <= 0:
        stop.wait()
    while not stop.wait(args.interval):
        if ranks is not None:
            ranks.run("step")
        else:
            trainer.step()


if __name__ == "__main__":
    main()
