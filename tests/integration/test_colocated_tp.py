"""Colocated as RL teams run it: every rank of a trainer pod publishes its own shard into
one engine, tensor parallel over the same devices.

Real processes on gloo/CPU: two trainer ranks (one torch.distributed job, FSDP2-style
`Shard(0)` DTensors, one Publisher each), their two source agents in one Colocated
group, and a reference engine of two tensor-parallel workers. The ranks assemble each
bucket in the lead's slots; the lead copies it to a second slot (on GPUs: the other
rank's GPU; here a second shared-memory slot) and worker w loads only from copy w (the
lead's slots grow in the first round, after the engine was attached: it is attached
again before the round opens its update). After
every round each worker serves the trainer's full tensors, bit for bit, having loaded
the whole model once. Between the five versions the trainer releases the engine's KV
cache and weights (`Publisher.release()` on every rank; the lead has every worker free
its weights: the tensor-parallel reference engine keeps no KV cache), measured on each
worker and restored by the next round; the engine restarted in
place is reloaded by the lead from its held copy, on both workers, without a round.

`run_colocated_tp` is the body; `tests/gpu/test_colocated_tp_nccl.py` runs it on two GPUs
(NCCL, CUDA IPC, the copies on the second GPU).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.stack import AgentProc, Engine, free_port, stack, wait_warm
from tests.support.eventually import eventually
from tests.support.plans import local_plan
from weightsync.api.control import Backend, LocalEngine, TransferOptions
from weightsync.api.v1alpha1 import MemoryRelease, SyncMode

pytestmark = pytest.mark.timeout(240)

RANKS = 2
PRESET = "uneven"
# The two largest tensors, whole on rank 1 (as experts are on their owner): the lead's
# own layout is smaller than the round's, so its slots and their copies grow in the
# first round, after the engine was attached to them (it is attached again).
OWNED_BY_RANK_1 = ("model.embed_tokens.weight", "lm_head.weight")
_REPLY_SECONDS = 60.0
RELEASE = -1  # the trainer ranks' command for `Publisher.release()`


@dataclass(frozen=True)
class Setup:
    """Where the ranks run: gloo on CPU here, NCCL with rank r on GPU r on a GPU host."""

    backend: Backend
    devices: tuple[str, ...]  # rank r's (its agent's, its trainer's, engine worker r's)


CPU = Setup(Backend.GLOO, ("cpu",) * RANKS)


def _trainer_rank(
    rank: int, port: int, socket: str, inbox: Any, outbox: Any, *, setup: Setup
) -> None:
    """One trainer rank: each version, the model's tensors as `Shard(0)` DTensors (norms
    replicated, `OWNED_BY_RANK_1` whole on rank 1), published; rank 0 answers the full
    tensors' digests too."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from weightsync.client import Publisher
    from weightsync.reference.memory import tensor_digest
    from weightsync.reference.model import PRESETS, build_model, randomize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device(setup.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(setup.backend.value, rank=rank, world_size=RANKS)
    mesh = init_device_mesh(device.type, (RANKS,))
    model = build_model(PRESETS[PRESET], seed=0, device=str(device))
    try:
        with Publisher(socket, timeout=60.0) as publisher:
            while (version := inbox.get()) is not None:
                if version == RELEASE:  # about to train: the engine gives its memory back
                    outbox.put((publisher.release(), None))
                    continue
                randomize(model, seed=4000 + version)
                tensors = {
                    name: distribute_tensor(
                        param.detach(),
                        mesh,
                        [Replicate() if name.endswith("norm.weight") else Shard(0)],
                        src_data_rank=None,
                    )
                    for name, param in model.named_parameters()
                    if name not in OWNED_BY_RANK_1
                }
                if rank == 1:  # whole, as an expert's owner holds it; rank 0 never sees it
                    tensors.update({n: p.detach() for n, p in model.named_parameters()
                                    if n in OWNED_BY_RANK_1})  # fmt: skip
                result = publisher.publish(tensors, version=version)
                digests = {n: tensor_digest(p) for n, p in model.named_parameters()}
                outbox.put((result.model_dump(), digests if rank == 0 else None))
    finally:
        dist.destroy_process_group()


def _payload() -> int:
    from weightsync.reference.model import PRESETS, build_model

    return sum(
        p.numel() * p.element_size() for p in build_model(PRESETS[PRESET], seed=0).parameters()
    )


def _plans(sources: list[AgentProc], engine: Engine, port: int, backend: Backend) -> None:
    pods = [s.proc.name for s in sources]
    transfer = TransferOptions(bucket_size_bytes=16 << 10, pipeline_depth=2, timeout_seconds=20.0)
    local = LocalEngine(pod=engine.proc.name, engine="Reference", url=engine.url,
                        memory_release=MemoryRelease.KV_CACHE_AND_WEIGHTS)  # fmt: skip
    for rank, agent in enumerate(sources):
        plan = local_plan(pods, rank, generation=1, port=port, backend=backend,
                          transfer=transfer, mode=SyncMode.COLOCATED, local_engine=local,
                          sources=RANKS)  # fmt: skip
        agent.put_plan(plan.model_copy(update={"holder": rank == 0}))  # Colocated: the lead
    wait_warm(sources, 1, timeout=40.0)


def _serves(engine: Engine, version: int, digests: dict[str, str] | None) -> None:
    assert digests is not None
    served = engine.digests()
    assert (served["version"], served["tensors"] == digests) == (version, True)
    workers = served["workers"]
    assert len(workers) == RANKS
    for index, worker in enumerate(workers):
        assert worker["version"] == version, index
        assert worker["tensors"] == digests, f"worker {index} differs from the trainer"


def test_every_rank_of_a_trainer_pod_feeds_one_tensor_parallel_engine(tmp_path: Path) -> None:
    run_colocated_tp(tmp_path, CPU)


def run_colocated_tp(tmp_path: Path, setup: Setup) -> None:
    context = mp.get_context("spawn")
    with stack(tmp_path) as st:
        first = setup.devices[0]
        engine = st.start_engine("engine-tp", preset=PRESET, seed=0, device=first, tp=RANKS)
        sources = [
            st.start_agent(f"trainer-0[{r}]", role="source", device=setup.devices[r])
            for r in range(RANKS)
        ]
        st.wait_ready(sources, [engine])
        _plans(sources, engine, free_port(), setup.backend)
        port = free_port()
        inboxes = [context.Queue() for _ in range(RANKS)]
        outboxes = [context.Queue() for _ in range(RANKS)]
        procs = [
            context.Process(
                target=_trainer_rank,
                args=(r, port, str(s.socket_path), inboxes[r], outboxes[r]),
                kwargs={"setup": setup},
                name=f"trainer-{r}",
            )
            for r, s in enumerate(sources)
        ]
        for proc in procs:
            proc.start()

        def publish_release() -> list[tuple[list[str], None]]:
            for inbox in inboxes:
                inbox.put(RELEASE)
            return [outbox.get(timeout=_REPLY_SECONDS) for outbox in outboxes]

        def publish(version: int) -> dict[str, str] | None:
            for inbox in inboxes:
                inbox.put(version)
            replies = [outbox.get(timeout=_REPLY_SECONDS) for outbox in outboxes]
            for result, _ in replies:
                assert result["ok"], result
                assert result["version"] == version
            return replies[0][1]

        def resident() -> int:
            value: int = engine.health()["resident_bytes"]  # both workers'
            return value

        try:
            payload = _payload()
            digests = publish(1)
            # The slots grew for the round: attached again before the update, then loaded.
            assert sources[0].proc.log.read_text().count("engine updates over") == 2
            awake = resident()
            for version in range(2, 6):
                # Released before "training" (each rank calls it; the lead frees the
                # engine's KV cache and weights on every worker), woken by the round.
                freed = [tags for tags, _ in publish_release()]
                assert freed == [["kv_cache", "weights"], []], freed
                asleep = resident()
                assert asleep + RANKS * payload <= awake, (asleep, awake)  # every worker's
                digests = publish(version)
                _serves(engine, version, digests)
                assert resident() == awake
                loaded = [w["loaded_bytes"] for w in engine.digests()["workers"]]
                assert loaded == [payload] * RANKS, loaded  # each worker: the whole model

            # Restarted in place on other weights: the lead reloads both workers from
            # the version it holds, with no round; rounds then go on.
            assert sources[0].status().holding == 5
            st.restart_engine(engine, seed=7)
            eventually(lambda: engine.health().get("version") == 5, timeout=30.0,
                       message="the engine reloaded with version 5")  # fmt: skip
            _serves(engine, 5, digests)
            _serves(engine, 6, publish(6))
        finally:
            for inbox in inboxes:
                inbox.put(None)
            for proc in procs:
                proc.join(timeout=20)
                if proc.is_alive():
                    proc.kill()
