"""The data-plane contract, one body for every backend (gloo on CPU in CI, NCCL on GPUs).

One source agent (the trainer's) and N sink agents, each feeding a reference engine:
rounds deliver bit-identical weights and identical greedy outputs; a sink killed
mid-round fails that round on every rank within the timeout and no engine serves the
half-sent version; the survivors complete the next round in a new generation.
"""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack import AgentProc, Engine, Stack, free_port, stack, wait_warm
from tests.support.eventually import eventually
from tests.support.plans import local_plan
from weightsync.agent.trace import PHASES_LOG_PREFIX
from weightsync.api.control import (
    Backend,
    LocalEngine,
    MembershipPlan,
    TransferOptions,
)
from weightsync.api.v1alpha1 import SyncMode
from weightsync.client import Publisher, PublishResult
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import (
    PRESETS,
    LlamaForCausalLM,
    build_model,
    greedy_generate,
    randomize,
)

PROMPTS = [[1, 2, 3, 4], [42], [7, 7, 7, 200, 13]]
NEW_TOKENS = 6


@dataclass(frozen=True)
class ContractConfig:
    backend: Backend
    devices: list[str]  # rank order: the source (trainer) first, then one per sink
    preset: str = "tiny"
    bucket_size_bytes: int = 16 << 10  # small buckets: many of them, so a kill lands mid-round
    timeout_seconds: float = 10.0
    rounds: int = 5
    # Test hook on the sinks: a pause per bucket keeps a round open long enough to kill.
    bucket_delay_seconds: float = 0.02
    checksum: bool = True


def make_plan(
    config: ContractConfig,
    generation: int,
    rank: int,
    pods: list[str],
    port: int,
    *,
    mode: SyncMode = SyncMode.DISAGGREGATED,
    local_engine: Engine | None = None,
) -> MembershipPlan:
    local = None
    if local_engine is not None:
        local = LocalEngine(pod=local_engine.proc.name, engine="Reference", url=local_engine.url)
    return local_plan(
        pods,
        rank,
        generation=generation,
        port=port,
        backend=config.backend,
        transfer=TransferOptions(
            bucket_size_bytes=config.bucket_size_bytes,
            pipeline_depth=2,
            timeout_seconds=config.timeout_seconds,
            checksum=config.checksum,
        ),
        sync_name="contract",
        mode=mode,
        local_engine=local,
    )


def apply_plan(config: ContractConfig, agents: list[AgentProc], generation: int, port: int) -> None:
    pods = [a.proc.name for a in agents]
    for rank, agent in enumerate(agents):
        accepted = agent.put_plan(make_plan(config, generation, rank, pods, port))
        assert accepted == {"generation": generation, "rank": rank, "world_size": len(agents)}
    wait_warm(agents, generation, timeout=40.0)


def assert_packed_by_the_agent_on_gpu(publisher: Publisher, device: str) -> None:
    """On GPU the agent packs from the shared tensors (the Publisher fills no bucket);
    on CPU the Publisher fills every bucket itself."""
    timings = publisher.last_timings
    assert timings is not None
    assert (timings.buckets == 0) == device.startswith("cuda"), timings


def assert_one_copy_on_gpu(source: AgentProc, device: str) -> None:
    """On GPU a Colocated round packs the trainer's tensors straight into the reference
    engine's arenas (`DirectStagingRound`: staged, never loaded from a slot) and the
    engine waits for the copies' CUDA event, not the agent; on CPU the Publisher packs
    into the slots and the engine's arenas are filled from them."""
    phases = []
    for line in source.proc.log.read_text(errors="replace").splitlines():
        at = line.find(PHASES_LOG_PREFIX)
        if at >= 0:
            phases.append(set(json.loads(line[at + len(PHASES_LOG_PREFIX) :])["spans"]))
    assert phases, "the source logged no round"
    direct = device.startswith("cuda")
    for spans in phases:
        assert ("pack" in spans) == direct, spans  # the packs' one hop
        assert "pack_drain" not in spans, spans  # the engine awaited the copies' event
        assert ("engine_load" in spans) == (not direct), spans


def expect_served(trainer: LlamaForCausalLM, engines: list[Engine], version: int) -> None:
    """Every engine serves `version`, bit-identical to the trainer, same greedy output;
    an engine of tensor-parallel workers on every worker."""
    want = {name: tensor_digest(p) for name, p in trainer.named_parameters()}
    reference = greedy_generate(trainer, PROMPTS, NEW_TOKENS)
    for engine in engines:
        served = engine.digests()
        assert served["version"] == version
        assert served["tensors"] == want, f"engine on port {engine.port} differs from trainer"
        for index, worker in enumerate(served.get("workers", [])):
            assert worker["version"] == version
            assert worker["tensors"] == want, f"worker {index} on {worker['device']} differs"
        generated = engine.generate(PROMPTS, NEW_TOKENS)
        assert generated == {"output_ids": reference, "weight_version": version}


def start(config: ContractConfig, workdir: Path, st: Stack) -> tuple[AgentProc, list[AgentProc]]:
    sinks: list[AgentProc] = []
    engines: list[Engine] = []
    for index, device in enumerate(config.devices[1:], start=1):
        engine = st.start_engine(
            f"engine-{index}",
            preset=config.preset,
            seed=0,
            device=device,
            load_delay_seconds=config.bucket_delay_seconds,
        )
        engines.append(engine)
        sinks.append(
            st.start_agent(
                f"sink-{index}",
                role="sink",
                device=device,
                engine=engine,
            )
        )
    source = st.start_agent("source-0", role="source", device=config.devices[0])
    st.wait_ready([source, *sinks], engines)
    return source, sinks


def run_contract(config: ContractConfig, workdir: Path) -> None:
    torch.manual_seed(0)
    with stack(workdir) as st:
        source, sinks = start(config, workdir, st)
        engines = [s.engine for s in sinks if s.engine is not None]
        port = free_port()
        apply_plan(config, [source, *sinks], generation=1, port=port)

        trainer = build_model(PRESETS[config.preset], seed=0, device=config.devices[0])
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            for version in range(1, config.rounds + 1):
                randomize(trainer, seed=1000 + version)
                result = publisher.publish(trainer.named_parameters(), version=version)
                assert result.ok, result
                assert result.version == version
                assert result.generation == 1
                assert_packed_by_the_agent_on_gpu(publisher, config.devices[0])
                assert result.bytes >= sum(
                    p.numel() * p.element_size() for p in trainer.parameters()
                )
                expect_served(trainer, engines, version)
            served = config.rounds

            # ---- a sink dies mid-round: the round fails everywhere, nobody serves it
            victim, survivors = sinks[-1], sinks[:-1]
            randomize(trainer, seed=7777)
            failed = publish_while_killing(publisher, trainer, served + 1, victim)
            assert not failed.ok
            # Put down to the member that died (it wrote no note; the others all did),
            # whatever connection gloo saw break first.
            assert failed.reason == "member_lost", failed
            assert failed.member.startswith(victim.proc.name), failed
            assert failed.stage in {"transfer", "timeout"}, failed
            assert failed.duration_seconds < config.timeout_seconds + 5.0
            for engine in engines:
                assert engine.health()["version"] == served
            for sink in survivors:
                last = eventually(
                    lambda s=sink: _last_round(s, served + 1), timeout=config.timeout_seconds + 5
                )
                assert not last.ok
                assert sink.status().version == served

            # ---- the operator plans generation 2 without the dead sink
            apply_plan(config, [source, *survivors], generation=2, port=port)
            result = publisher.publish(trainer.named_parameters(), version=served + 1)
            assert result.ok, result
            assert result.generation == 2
            expect_served(trainer, engines[:-1], served + 1)
            assert engines[-1].health()["version"] == served

        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(source.metrics())
            for s in family.samples
        }
        source_label = (("role", "source"),)
        assert samples[("weightsync_current_version", source_label)] == served + 1
        assert samples[("weightsync_prewarm_duration_seconds_count", source_label)] == 2
        assert samples[("weightsync_round_duration_seconds_count", source_label)] == served + 2
        reason = (("reason", failed.reason), ("role", "source"), ("stage", failed.stage))
        assert samples[("weightsync_round_failures_total", reason)] == 1


def _last_round(agent: AgentProc, version: int) -> object:
    last = agent.status().last_round
    return last if last is not None and last.version == version else None


@dataclass
class MidRound:
    """A publish() running on a thread of its own (see `publish_mid_round`)."""

    thread: threading.Thread
    outcome: list[PublishResult | BaseException]

    def result(self, timeout: float = 60.0) -> PublishResult:
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), f"publish did not return within {timeout:.0f} s"
        result = self.outcome[0]
        if isinstance(result, BaseException):
            raise result
        return result


def publish_mid_round(
    publisher: Publisher, trainer: torch.nn.Module, version: int, victim: AgentProc
) -> MidRound:
    """Start publishing `version` on a thread; return once `victim`'s engine has loaded a
    few buckets of it, so a fault injected next lands in the middle of the round."""
    outcome: list[PublishResult | BaseException] = []

    def publish() -> None:
        try:
            outcome.append(publisher.publish(trainer.named_parameters(), version=version))
        except BaseException as exc:  # handed to the test thread by `result`
            outcome.append(exc)

    thread = threading.Thread(target=publish, name="publish")
    thread.start()
    engine = victim.engine
    assert engine is not None
    eventually(
        lambda: engine.health()["staged_buckets"] >= 2,
        timeout=20,
        interval=0.02,
        message="a few buckets into the round",
    )
    return MidRound(thread, outcome)


def publish_while_killing(
    publisher: Publisher, trainer: LlamaForCausalLM, version: int, victim: AgentProc
) -> PublishResult:
    running = publish_mid_round(publisher, trainer, version, victim)
    victim.proc.popen.send_signal(signal.SIGKILL)
    return running.result()


def run_colocated(workdir: Path, device: str, rounds: int = 3) -> None:
    """Colocated mode: the engine the plan names reads the source agent's own slots; no
    broadcast. A new generation naming another engine (its pod was replaced) moves the
    hand-off there at the next round."""
    config = ContractConfig(
        backend=Backend.NCCL if device.startswith("cuda") else Backend.GLOO, devices=[device]
    )
    with stack(workdir) as st:
        first = st.start_engine("engine-0", preset=config.preset, seed=0, device=device)
        second = st.start_engine("engine-1", preset=config.preset, seed=0, device=device)
        source = st.start_agent("source-0", role="source", device=device)
        st.wait_ready([source], [first, second])
        trainer = build_model(PRESETS[config.preset], seed=0, device=device)
        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            for generation, engine in enumerate([first, second], start=1):
                plan = make_plan(
                    config, generation, 0, ["source-0"], free_port(),
                    mode=SyncMode.COLOCATED, local_engine=engine,
                )  # fmt: skip
                source.put_plan(plan)
                wait_warm([source], generation, timeout=30.0)
                for step in range(1, rounds + 1):
                    version = (generation - 1) * rounds + step
                    randomize(trainer, seed=2000 + version)
                    result = publisher.publish(trainer.named_parameters(), version=version)
                    assert result.ok, result
                    assert_packed_by_the_agent_on_gpu(publisher, device)
                    expect_served(trainer, [engine], version)
        assert_one_copy_on_gpu(source, device)
        assert first.digests()["version"] == rounds  # left alone once replaced
        assert second.health()["version"] == 2 * rounds
