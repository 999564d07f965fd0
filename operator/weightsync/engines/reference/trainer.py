"""A tiny trainer for tests and the demo: the reference model, real optimizer steps, Publisher.

    python -m weightsync.engines.reference.trainer --preset tiny --interval 5
    python -m weightsync.engines.reference.trainer --host $(POD_IP) --port 8080 --interval 0

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
import threading
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from weightsync.client import Publisher, PublisherError, PublishResult
from weightsync.engines.reference.engine import tensor_digest
from weightsync.engines.reference.model import PRESETS, LlamaForCausalLM, build_model

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


class Trainer:
    """One model, one optimizer, one Publisher; `step()` is serialised."""

    def __init__(self, preset: str, seed: int, lr: float, publish_timeout: float) -> None:
        torch.manual_seed(seed)
        self.model: LlamaForCausalLM = build_model(PRESETS[preset], seed).train()
        self.model.requires_grad_(True)
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
                report = StepReport(self.version, False, error.reason, str(error))
            else:
                report = StepReport(
                    result.version,
                    result.ok,
                    result.reason,
                    result.message,
                    result.generation,
                    result.duration_seconds,
                    result.bytes,
                )
            self.last = report
            log.info("step %d published: %s", self.version, report)
            return report

    def digests(self) -> dict[str, Any]:
        """The weights' digests, comparable with an engine's `/v1/weights/digest`."""
        with self._lock:
            tensors = {name: tensor_digest(p) for name, p in self.model.named_parameters()}
            return {"version": self.version, "tensors": tensors}


def _handler(trainer: Trainer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: dict[str, Any]) -> None:
            payload = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            if self.path != "/step":
                self.send_error(404)
                return
            self._reply(asdict(trainer.step()))

        def do_GET(self) -> None:
            if self.path == "/digest":
                self._reply(trainer.digests())
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    trainer = Trainer(args.preset, args.seed, args.lr, args.publish_timeout)
    if args.port:
        server = ThreadingHTTPServer((args.host, args.port), _handler(trainer))
        threading.Thread(target=server.serve_forever, daemon=True, name="step-endpoint").start()
        log.info("POST http://%s:%d/step runs a step", args.host, args.port)
    stop = threading.Event()
    if args.interval <= 0:
        stop.wait()
    while not stop.wait(args.interval):
        trainer.step()


if __name__ == "__main__":
    main()
