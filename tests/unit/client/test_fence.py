"""The Publisher's fence, against a scripted agent on a real Unix socket.

The scripted agent stands in for a GPU source agent that maps the Publisher's tensors
(CUDA IPC, which a CPU machine cannot do) and answers a round with `holding`: its copy
of the tensors for the holder outlasts the round. The real agent's side of the same
exchange runs in tests/gpu/test_holder_fence_gpu.py.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from weightsync.client import Publisher
from weightsync.transfer.buffers import SlotHandles
from weightsync.transfer.handoff import (
    Attach,
    Attached,
    Fence,
    Fenced,
    Message,
    Publish,
    PublishResult,
    recv_message,
    send_message,
)
from weightsync.transfer.layout import TensorMeta, plan_layout

BUCKET = 4096


class ScriptedAgent:
    """Answers Attach, Publish (ok, `holding`) and Fence; records what it was sent."""

    def __init__(self, path: Path) -> None:
        self.received: list[Message] = []
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._server.accept()
        with conn:
            held = None
            while True:
                try:
                    message = recv_message(conn)
                except Exception:  # the Publisher closed: the script ends
                    return
                self.received.append(message)
                if isinstance(message, Attach):
                    metas = [TensorMeta(n, tuple(s), d) for n, s, d in message.tensors]
                    layout = plan_layout(metas, BUCKET)
                    reply: Attached | PublishResult | Fenced = Attached(
                        layout_hash=layout.layout_hash,
                        bucket_size_bytes=BUCKET,
                        alignment=layout.alignment,
                        slots=SlotHandles(slots=[]),
                        agent_packs=True,
                    )
                elif isinstance(message, Publish):
                    reply = PublishResult(
                        version=message.version, ok=True, duration_seconds=0.01, bytes=0,
                        holding=True,
                    )  # fmt: skip
                elif isinstance(message, Fence):
                    held = message.version if message.clean else held
                    reply = Fenced(version=message.version, held=held == message.version)
                else:
                    raise TypeError(f"unexpected {message!r}")
                send_message(conn, reply)

    def sent(self, kind: type) -> list[Message]:
        return [m for m in self.received if isinstance(m, kind)]

    def close(self) -> None:
        self._server.close()
        self._thread.join(timeout=5)


@contextmanager
def scripted(tmp_path: Path) -> Iterator[tuple[ScriptedAgent, Publisher]]:
    agent = ScriptedAgent(tmp_path / "agent.sock")
    publisher = Publisher(tmp_path / "agent.sock", timeout=10)
    try:
        yield agent, publisher
    finally:
        publisher.close()
        agent.close()


def test_publish_returns_holding_and_a_fence_before_writing_keeps_the_copy(
    tmp_path: Path,
) -> None:
    weights = {"w": torch.ones(64), "b": torch.zeros(8)}
    with scripted(tmp_path) as (agent, publisher):
        result = publisher.publish(weights, version=1)
        assert result.ok
        assert result.holding
        assert agent.sent(Fence) == [], "publish() did not wait for the holder's copy"
        assert publisher.fence(), "the tensors were not written: the agent holds version 1"
        assert agent.sent(Fence) == [Fence(version=1, clean=True)]
        assert not publisher.fence(), "nothing pending: no message"
        assert len(agent.sent(Fence)) == 1
        weights["w"].add_(1.0)  # the optimizer step, after the fence
        assert publisher.publish(weights, version=2).ok
        assert not publisher.fence_in_publish


def test_tensors_written_before_the_fence_drop_the_copy_and_publish_waits_from_then_on(
    tmp_path: Path,
) -> None:
    weights = {"w": torch.ones(64), "b": torch.zeros(8)}
    with scripted(tmp_path) as (agent, publisher):
        assert publisher.publish(weights, version=1).holding
        weights["w"].mul_(2.0)  # an optimizer step with no fence
        assert publisher.publish(weights, version=2).ok
        fences = agent.sent(Fence)
        # Version 1 was written before its fence: dropped. Version 2 is fenced inside its
        # own publish() from now on, so the trainer cannot write under the copy.
        assert fences == [Fence(version=1, clean=False), Fence(version=2, clean=True)]
        assert publisher.fence_in_publish
        timings = publisher.last_timings
        assert timings is not None
        assert timings.fence > 0


def test_guard_fences_before_every_optimizer_step(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.ones(32))
    optimizer = torch.optim.SGD([param], lr=0.1)
    with scripted(tmp_path) as (agent, publisher):
        handle = publisher.guard(optimizer)
        assert publisher.publish({"w": param.detach()}, version=1).holding
        param.grad = torch.ones(32)
        optimizer.step()
        assert agent.sent(Fence) == [Fence(version=1, clean=True)]
        assert publisher.publish({"w": param.detach()}, version=2).ok
        assert len(agent.sent(Fence)) == 1, "the step's fence came before the write"
        handle.remove()
