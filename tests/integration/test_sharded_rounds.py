"""Sharded trainers: four trainer ranks each publish their own shard to three engines.

Real processes on gloo/CPU: four trainer ranks (one torch.distributed job, one Publisher
each), four source agents, three sink agents each feeding a reference engine. The
trainers hold the reference model ("uneven" preset: vocabulary 250 and MLP width 90
shard unevenly over 4) as:

* FSDP2-style `Shard(0)` DTensors over all four ranks (uneven: 63, 63, 63, 61 rows);
* tensor-parallel blocks: `Shard(1)` over four ranks, and `[Shard(0), Shard(1)]` over a
  2x2 mesh;
* replicated norms (`Replicate()`, sent by rank 0 only);
* expert-parallel ownership: a layer's MLP weights whole on one rank, a plain tensor
  that the other ranks do not publish at all (the reference model has no experts: its
  MLPs stand in for them);
* and, in the last healthy round, a real FSDP2 `fully_shard` model after an optimizer
  step on synthetic data.

Every engine serves, bit for bit, the trainer's full tensors (`DTensor.full_tensor()`).
A source rank that never calls publish (the lead included), and a source agent killed
mid-round, each fail the round on every trainer rank within the timeout, naming that rank.
A round that cannot be planned (a rank leaves out its rows of a tensor, or two ranks
disagree on a tensor's shape) fails on every rank, naming the tensor, and the next
generation's round goes through; so does the first round after a sink agent is replaced
by a fresh one, checksums on (the padding between tensors is not compared).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.stack import AgentProc, Engine, Stack, free_port, stack, wait_warm
from tests.support.eventually import eventually
from tests.support.plans import local_plan
from weightsync.api.control import Backend, TransferOptions

pytestmark = pytest.mark.timeout(300)

WORLD = 4
SINKS = 3
PRESET = "uneven"
TIMEOUT_SECONDS = 10.0
_REPLY_SECONDS = TIMEOUT_SECONDS + 30.0


def _placed(model: Any, rank: int, flat: Any, grid: Any) -> dict[str, Any]:
    """The model's tensors as the mixed trainer holds them (module doc). Every rank holds
    the full model and cuts its own pieces: no collective, so a rank that skips a step
    cannot hang the others."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tensors: dict[str, Any] = {}
    for name, param in model.named_parameters():
        full = param.detach()
        if name.endswith("norm.weight"):
            tensors[name] = distribute_tensor(full, flat, [Replicate()], src_data_rank=None)
        elif ".mlp." in name:  # "experts": layer i's MLP lives on rank i + 1
            owner = int(name.split(".")[2]) + 1
            if rank == owner:
                tensors[name] = full.clone()
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = distribute_tensor(full, grid, [Shard(0), Shard(1)], src_data_rank=None)
        elif name == "lm_head.weight":
            tensors[name] = distribute_tensor(full, flat, [Shard(1)], src_data_rank=None)
        else:  # embeddings, k and v: FSDP2's dim-0 shards
            tensors[name] = distribute_tensor(full, flat, [Shard(0)], src_data_rank=None)
    return tensors


def _trainer_rank(rank: int, port: int, socket: str, inbox: Any, outbox: Any) -> None:
    """One trainer rank: publishes what the test asks, answers (result, full digests)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from weightsync.client import Publisher
    from weightsync.reference.memory import tensor_digest
    from weightsync.reference.model import PRESETS, build_model, randomize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    flat = init_device_mesh("cpu", (WORLD,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build_model(PRESETS[PRESET], seed=0)
    try:
        with Publisher(socket, timeout=60.0) as publisher:
            while (command := inbox.get()) is not None:
                kind, version = command
                if kind in ("placed", "omit", "shape"):
                    randomize(model, seed=1000 + version)
                    tensors = _placed(model, rank, flat, grid)
                    full = dict(model.named_parameters())
                    if kind == "omit" and rank == 1:  # its rows of the embedding are missing
                        del tensors["model.embed_tokens.weight"]
                    if kind == "shape" and rank == 2:  # another global shape for the norm
                        shorter = full["model.norm.weight"].detach()[:-1]
                        tensors["model.norm.weight"] = distribute_tensor(
                            shorter, flat, [Replicate()], src_data_rank=None
                        )
                else:  # "fsdp": a real FSDP2 model, one optimizer step
                    torch.manual_seed(version)
                    trained = build_model(PRESETS[PRESET], seed=version)
                    trained.train()
                    for param in trained.parameters():
                        param.requires_grad_(True)
                    for layer in trained.model.layers:
                        fully_shard(layer, mesh=flat)
                    fully_shard(trained, mesh=flat)
                    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
                    tokens = torch.randint(0, PRESETS[PRESET].vocab_size, (2, 9))
                    logits = trained(tokens[:, :-1])
                    loss = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
                    )
                    loss.backward()
                    optimizer.step()
                    tensors = {n: p.detach() for n, p in trained.named_parameters()}
                    full = {n: t.full_tensor() for n, t in tensors.items()}  # collective
                result = publisher.publish(tensors, version=version)
                digests = {n: tensor_digest(t) for n, t in full.items()} if rank == 0 else None
                outbox.put((result.model_dump(), digests))
    finally:
        dist.destroy_process_group()


class Trainer:
    """The four trainer ranks, driven round by round from the test."""

    def __init__(self, sources: list[AgentProc]) -> None:
        context = mp.get_context("spawn")
        port = free_port()
        self.inboxes = [context.Queue() for _ in range(WORLD)]
        self.outboxes = [context.Queue() for _ in range(WORLD)]
        self.procs = [
            context.Process(
                target=_trainer_rank,
                args=(rank, port, str(s.socket_path), self.inboxes[rank], self.outboxes[rank]),
                name=f"trainer-{rank}",
            )
            for rank, s in enumerate(sources)
        ]
        for proc in self.procs:
            proc.start()

    def publish(
        self, kind: str, version: int, ranks: range | list[int] = range(WORLD)
    ) -> list[tuple[dict[str, Any], dict[str, str] | None]]:
        for rank in ranks:
            self.inboxes[rank].put((kind, version))
        return [self.outboxes[rank].get(timeout=_REPLY_SECONDS) for rank in ranks]

    def close(self) -> None:
        for inbox, proc in zip(self.inboxes, self.procs, strict=True):
            if proc.is_alive():
                inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()


def _apply(agents: list[AgentProc], generation: int, port: int) -> None:
    pods = [a.proc.name for a in agents]
    transfer = TransferOptions(
        bucket_size_bytes=16 << 10, pipeline_depth=2, timeout_seconds=TIMEOUT_SECONDS, checksum=True
    )
    for rank, agent in enumerate(agents):
        plan = local_plan(
            pods,
            rank,
            generation=generation,
            port=port,
            backend=Backend.GLOO,
            transfer=transfer,
            sync_name="sharded",
            sources=WORLD,
        )
        agent.put_plan(plan)
    wait_warm(agents, generation, timeout=40.0)


def _served(engines: list[Engine], version: int, digests: dict[str, str] | None) -> None:
    assert digests is not None
    for engine in engines:
        served = engine.digests()
        assert served["version"] == version, engine.port
        assert served["tensors"] == digests, f"engine on port {engine.port} differs"


def _unplannable_rounds(
    trainer: Trainer, agents: list[AgentProc], engines: list[Engine], port: int, generation: int
) -> int:
    """Rounds that cannot be planned fail on every rank, naming the tensor, and the next
    generation's round goes through (no member is left waiting on the failed one)."""
    for version, (kind, tensor) in enumerate(
        (("omit", "model.embed_tokens.weight"), ("shape", "model.norm.weight")), start=6
    ):
        _apply(agents, generation=generation, port=port)
        for result, _ in trainer.publish(kind, version):
            assert not result["ok"]
            assert result["reason"] == "bad_shards", result
            assert tensor in result["message"], result
            assert result["duration_seconds"] < TIMEOUT_SECONDS + 5.0
        generation += 1
        _apply(agents, generation=generation, port=port)
        replies = trainer.publish("placed", version)
        for result, _ in replies:
            assert result["ok"], result
            assert result["generation"] == generation
        _served(engines, version, replies[0][1])
    return generation


def _replaced_sink(
    st: Stack,
    trainer: Trainer,
    *,
    sources: list[AgentProc],
    sinks: list[AgentProc],
    engines: list[Engine],
    port: int,
    generation: int,
) -> None:
    """A sink agent replaced by a fresh one (fresh slots): with checksums on, the first
    round agrees on every bucket, and engines serve it bit for bit."""
    sinks[0].proc.kill()
    sinks[0] = st.start_agent("sink-1b", role="sink", device="cpu", engine=engines[0])
    eventually(sinks[0].status, timeout=30, interval=0.2, message="sink-1b up")
    _apply([*sources, *sinks], generation=generation, port=port)
    replies = trainer.publish("placed", 8)
    for result, _ in replies:
        assert result["ok"], result
    _served(engines, 8, replies[0][1])


def test_sharded_trainer_publishes_to_every_engine(tmp_path: Path) -> None:
    with stack(tmp_path) as st:
        engines = [
            st.start_engine(
                f"engine-{i}", preset=PRESET, seed=0, device="cpu", load_delay_seconds=0.05
            )
            for i in range(1, SINKS + 1)
        ]
        sinks = [
            st.start_agent(f"sink-{i}", role="sink", device="cpu", engine=engine)
            for i, engine in enumerate(engines, start=1)
        ]
        sources = [st.start_agent(f"source-{r}", role="source", device="cpu") for r in range(WORLD)]
        agents = [*sources, *sinks]
        st.wait_ready(agents, engines)
        port = free_port()
        _apply(agents, generation=1, port=port)
        trainer = Trainer(sources)
        try:
            # ---- three versions, every layout kind, bit-identical on every engine
            for version, kind in ((1, "placed"), (2, "placed"), (3, "fsdp")):
                replies = trainer.publish(kind, version)
                for result, _ in replies:
                    assert result["ok"], result
                    assert result["version"] == version
                _served(engines, version, replies[0][1])

            # ---- rank 3 never calls publish: every rank that did fails, naming it
            started = time.monotonic()
            replies = trainer.publish("placed", 4, ranks=[0, 1, 2])
            for result, _ in replies:
                assert not result["ok"]
                assert result["reason"] == "source_missing", result
                assert result["member"].startswith("source-3 (rank 3"), result
                assert result["duration_seconds"] < TIMEOUT_SECONDS + 5.0
            assert time.monotonic() - started < TIMEOUT_SECONDS + 10.0
            for engine in engines:
                assert engine.health()["version"] == 3

            # ---- a new generation: every rank publishes again, rank 3 included
            _apply(agents, generation=2, port=port)
            replies = trainer.publish("placed", 5)
            for result, _ in replies:
                assert result["ok"], result
                assert result["generation"] == 2
            _served(engines, 5, replies[0][1])

            # ---- the lead (rank 0) never calls publish: the ranks that waited name it
            replies = trainer.publish("placed", 6, ranks=[1, 2, 3])
            for result, _ in replies:
                assert not result["ok"]
                assert result["reason"] == "source_missing", result
                assert result["member"].startswith("source-0 (rank 0"), result
                assert result["duration_seconds"] < TIMEOUT_SECONDS + 5.0
            for engine in engines:
                assert engine.health()["version"] == 5

            generation = _unplannable_rounds(trainer, agents, engines, port, generation=3)
            _replaced_sink(
                st,
                trainer,
                sources=sources,
                sinks=sinks,
                engines=engines,
                port=port,
                generation=generation + 1,
            )

            # ---- source agent 2 dies mid-round: every other rank fails, naming it
            victim = sources[2]
            for rank in range(WORLD):
                trainer.inboxes[rank].put(("placed", 9))
            time.sleep(0.5)  # engines load a bucket per 50 ms: the round is under way
            victim.proc.kill()
            started = time.monotonic()
            for rank in (0, 1, 3):
                result, _ = trainer.outboxes[rank].get(timeout=_REPLY_SECONDS)
                assert not result["ok"]
                assert result["member"].startswith("source-2 (rank 2"), result
                assert result["duration_seconds"] < TIMEOUT_SECONDS + 5.0
            assert time.monotonic() - started < TIMEOUT_SECONDS + 5.0
            for engine in engines:
                assert engine.health()["version"] == 8
        finally:
            trainer.close()
