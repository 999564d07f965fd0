"""P2P recovery on CPU: real agents and reference engines, gloo rounds, Mooncake over TCP.

The test plays the operator (plans, POST /v1/recover, GET /v1/status) and the trainer
(Publisher). Every agent binds its transfer engine to its own 127.0.0.x address, as
pods have their own IPs.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.contract import ContractConfig, expect_served, make_plan
from tests.integration.stack import (
    STARTUP_TIMEOUT,
    AgentProc,
    Stack,
    free_port,
    http_json,
    stack,
    wait_warm,
)
from tests.support.eventually import eventually
from weightsync.agent.bucket_pull import PullSummary, pull_buckets
from weightsync.agent.holder import Holder
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.recovery import choose_holders
from weightsync.api.control import (
    Backend,
    Holding,
    MembershipPlan,
    RecoverRequest,
    RecoveryState,
    RecoveryStatus,
)
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.client import Publisher
from weightsync.reference.model import PRESETS, build_model, randomize
from weightsync.transfer.held import held_offsets
from weightsync.transfer.layout import Bucket, TensorMeta, plan_layout
from weightsync.transfer.p2p import Chunk, Endpoints, HeldRegion, pull

CONFIG = ContractConfig(backend=Backend.GLOO, devices=["cpu"] * 5, timeout_seconds=20.0)
RECOVERY_TIMEOUT = 60.0
# The second recovery's agent sleeps this long per bucket before its engine load, so the
# holder killed during it dies with most buckets still to pull (tiny: ~19 buckets).
KILL_WINDOW_DELAY = 0.1


# ------------------------------------------------------------------ in-process pulls
@pytest.fixture
def endpoints() -> Iterator[Endpoints]:
    made = Endpoints(lambda: "127.0.0.41")
    yield made
    made.close()


def _held_bytes(holder: Holder) -> torch.Tensor | None:
    held = holder.held
    return None if held is None else held.buffer[: held.layout.total_bytes]


def test_a_chunk_given_back_by_a_dead_holder_finds_a_taker(endpoints: Endpoints) -> None:
    """One chunk, the dead holder first: its reader takes the chunk, fails and puts it
    back after the live holder's reader found the queue empty; the live one must wait."""
    holder_end = endpoints.get(RecoveryProtocol.TCP)
    puller = Endpoints(lambda: "127.0.0.42").get(RecoveryProtocol.TCP)
    held = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    holder_end.register(held)
    live = HeldRegion("live", holder_end.segment, held.data_ptr(), held.numel())
    dead = HeldRegion("dead", f"127.0.0.43:{free_port()}", held.data_ptr(), held.numel())
    for _ in range(20):  # the race the old reader lost about once in five pulls
        destination = torch.zeros_like(held)
        report = pull(puller, [dead, live], [Chunk(0, held.numel())], destination)
        assert torch.equal(destination, held)
        assert report.bytes_by_holder["live"] == held.numel()
        assert "read_failed" in report.failed_holders["dead"]
    puller.close()


def _staged_holder(
    endpoints: Endpoints, layout_sizes: list[int], buckets: list[torch.Tensor] | None = None
) -> tuple[Holder, list[torch.Tensor]]:
    """A real holder that committed version 1 (given bytes, or random ones) by rounds."""
    layout = plan_layout(
        [TensorMeta(f"w{i}", (n,), "float32") for i, n in enumerate(layout_sizes)], 4096
    )
    generator = torch.Generator().manual_seed(11)
    if buckets is None:
        buckets = [
            torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, generator=generator)
            for b in layout.buckets
        ]
    holder = Holder(
        torch.device("cpu"), endpoints, RecoveryProtocol.TCP, AgentMetrics("sink"), enabled=True
    )
    slot = torch.zeros(layout.capacity_bytes, dtype=torch.uint8)

    async def stage() -> None:
        for bucket in layout.buckets:
            slot[: bucket.nbytes].copy_(buckets[bucket.index])
            await holder.stage(1, layout, bucket, slot, 1)

    asyncio.run(stage())
    assert holder.commit(1, "L1")
    return holder, buckets


def test_a_corrupt_holder_is_dropped_and_its_buckets_come_from_the_other() -> None:
    sizes = [500, 900, 300, 1000, 700, 200, 1000, 600]
    made = [Endpoints(lambda: "127.0.0.44"), Endpoints(lambda: "127.0.0.45")]
    good, buckets = _staged_holder(made[0], sizes)
    bad, _ = _staged_holder(made[1], sizes, buckets)
    good_holding, bad_holding = asyncio.run(good.holding()), asyncio.run(bad.holding())
    assert good_holding is not None
    assert bad_holding is not None
    assert good_holding.checksums == bad_holding.checksums
    held = _held_bytes(bad)
    assert held is not None
    request = RecoverRequest(
        version=1, lineage="L1", holders=["http://bad:1"], protocol=RecoveryProtocol.TCP
    )
    agreement = choose_holders(request, ["bad", "good"], {"bad": bad_holding, "good": good_holding})
    for offset in held_offsets(agreement.layout):  # a flipped byte in every bucket
        held[offset] ^= 0xFF
    layout = agreement.layout
    slots = [torch.zeros(layout.capacity_bytes, dtype=torch.uint8) for _ in range(2)]
    loaded: list[torch.Tensor] = []

    async def load(bucket: Bucket, slot: int) -> None:
        loaded.append(slots[slot][: bucket.nbytes].clone())

    regions = [HeldRegion(url, h.segment, h.address, h.nbytes) for url, h in agreement.holders]
    puller = Endpoints(lambda: "127.0.0.46")
    summary = PullSummary()
    asyncio.run(
        pull_buckets(
            puller.get(RecoveryProtocol.TCP),
            regions,
            layout,
            agreement.checksums,
            slots,
            deadline=time.monotonic() + 60,
            load=load,
            summary=summary,
        )
    )
    assert len(loaded) == len(buckets)
    for got, want in zip(loaded, buckets, strict=True):
        assert torch.equal(got, want)
    assert summary.bytes == layout.total_bytes
    assert summary.bytes_by_holder.get("bad", 0) == 0
    assert "checksum_mismatch" in summary.failed_holders["bad"]
    assert summary.bytes_by_holder["good"] == layout.total_bytes
    for holder in (good, bad):
        holder.close()
    for each in (*made, puller):
        each.close()


# ------------------------------------------------------------------ agents and engines
def _p2p_env(index: int) -> dict[str, str]:
    return {"WEIGHTSYNC_P2P_HOST": f"127.0.0.{21 + index}", "WEIGHTSYNC_P2P_PROTOCOL": "tcp"}


def _sink(st: Stack, index: int, delay: float = 0.0) -> AgentProc:
    engine = st.start_engine(
        f"engine-{index}", preset=CONFIG.preset, seed=0, device="cpu", load_delay_seconds=delay
    )
    agent = st.start_agent(
        f"sink-{index}", role="sink", device="cpu", engine=engine, extra_env=_p2p_env(index)
    )
    _wait_up(agent)
    return agent


def _wait_up(agent: AgentProc) -> None:
    """Like `Stack.wait_ready`, for one new pod: killed pods of this test stay dead."""

    def up() -> bool:
        for proc in (agent.proc, *([agent.engine.proc] if agent.engine else [])):
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        if agent.engine is not None:
            agent.engine.health()
        agent.status()
        return True

    eventually(up, timeout=STARTUP_TIMEOUT, interval=0.2, message=f"{agent.proc.name} up")


def _plan(
    agents: list[AgentProc], generation: int, port: int, holders: set[str]
) -> list[MembershipPlan]:
    pods = [a.proc.name for a in agents]
    return [
        make_plan(CONFIG, generation, rank, pods, port).model_copy(
            update={"holder": agent.proc.name in holders}
        )
        for rank, agent in enumerate(agents)
    ]


def _apply(agents: list[AgentProc], generation: int, port: int, holders: set[str]) -> None:
    for agent, plan in zip(agents, _plan(agents, generation, port, holders), strict=True):
        agent.put_plan(plan)
    wait_warm(agents, generation, timeout=40.0)


def _holding(agent: AgentProc) -> Holding:
    return Holding.model_validate(http_json("GET", f"{agent.url}/v1/holding", None, agent.token))


def _http_error(method: str, url: str, body: str | None, token: str) -> tuple[int, str]:
    with pytest.raises(urllib.error.HTTPError) as caught:
        http_json(method, url, body, token)
    return caught.value.code, json.loads(caught.value.read())["error"]


def _recover(agent: AgentProc, version: int, holders: list[AgentProc | str]) -> RecoveryStatus:
    urls = [h if isinstance(h, str) else h.url for h in holders]
    request = RecoverRequest(version=version, holders=urls, protocol=RecoveryProtocol.TCP)
    started = RecoveryStatus.model_validate(
        http_json("POST", f"{agent.url}/v1/recover", request.model_dump_json(), agent.token)
    )
    assert started.state in (RecoveryState.PENDING, RecoveryState.RUNNING)
    assert started.version == version
    return started


def _finished(agent: AgentProc) -> RecoveryStatus:
    def done() -> RecoveryStatus | None:
        status = agent.status().recovery
        finished = (RecoveryState.DONE, RecoveryState.FAILED)
        return status if status is not None and status.state in finished else None

    return eventually(done, timeout=RECOVERY_TIMEOUT, interval=0.05, message="recovery over")


def _samples(agent: AgentProc) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(agent.metrics())
        for s in family.samples
    }


@pytest.mark.timeout(300)
def test_restarted_sink_recovers_from_holders(tmp_path: Path) -> None:
    torch.manual_seed(0)
    port = free_port()
    trainer = build_model(PRESETS[CONFIG.preset], seed=0, device="cpu")
    with stack(tmp_path) as st:
        source = st.start_agent("source-0", role="source", device="cpu", extra_env=_p2p_env(0))
        sink1, sink2 = _sink(st, 1), _sink(st, 2)
        _wait_up(source)
        _apply([source, sink1, sink2], 1, port, holders={"sink-2"})
        engine = {a.proc.name: a.engine for a in (sink1, sink2)}

        assert source.socket_path is not None
        with Publisher(source.socket_path, timeout=60.0) as publisher:
            for version in (1, 2):
                randomize(trainer, seed=100 + version)
                assert publisher.publish(trainer.named_parameters(), version=version).ok
            expect_served(trainer, [e for e in engine.values() if e], 2)

            # ---- the source (by default) and sink-2 (by plan) hold version 2, alike
            held = {a.proc.name: _holding(a) for a in (source, sink2)}
            assert {h.version for h in held.values()} == {2}
            assert held["source-0"].checksums == held["sink-2"].checksums
            assert held["source-0"].layout_hash == held["sink-2"].layout_hash
            assert held["source-0"].segment.startswith("127.0.0.21:")
            assert held["sink-2"].segment.startswith("127.0.0.23:")
            assert [source.status().holding, sink2.status().holding] == [2, 2]
            assert sink1.status().holding is None
            assert _http_error("GET", f"{sink1.url}/v1/holding", None, sink1.token) == (
                404,
                "not_holding",
            )

            # ---- a failed round (the engines refuse a tensor they do not have, after the
            # holders staged its buckets) leaves the held copies alone
            randomize(trainer, seed=999)
            renamed = {f"{name}.unknown": t for name, t in trainer.named_parameters()}
            refused = publisher.publish(renamed, version=3)
            assert not refused.ok
            assert refused.reason == "engine_unknown_tensor", refused
            assert refused.stage == "engine_load", refused
            for agent in (source, sink2):
                assert _holding(agent) == held[agent.proc.name]

            # ---- sink-1's pod dies between rounds; the survivors go on in generation 2
            sink1.proc.kill()
            assert sink1.engine is not None
            sink1.engine.proc.kill()
            _apply([source, sink2], 2, port, holders={"sink-2"})
            randomize(trainer, seed=103)
            assert publisher.publish(trainer.named_parameters(), version=3).ok

            # ---- a fresh sink recovers version 3 (the dead sink-1 is named too)
            sink3 = _sink(st, 3)
            _recover(sink3, 3, [source, sink2, sink1.url])
            first = _finished(sink3)
            assert first.state == RecoveryState.DONE, first
            assert first.bytes == _holding(source).nbytes
            assert first.holders_failed[sink1.url].startswith("unreachable"), first
            assert set(first.holders_used) <= {source.url, sink2.url}
            assert first.holders_used
            assert sink3.status().version == 3
            assert sink3.engine is not None
            expect_served(trainer, [sink3.engine], 3)
            metrics = _samples(sink3)
            sink_label = (("role", "sink"),)
            assert metrics[("weightsync_recovery_bytes_total", sink_label)] == first.bytes
            assert metrics[("weightsync_recovery_duration_seconds_count", sink_label)] == 1
            assert metrics[("weightsync_current_version", sink_label)] == 3
            assert metrics[("weightsync_held_version", sink_label)] == -1
            assert _http_error("POST", f"{source.url}/v1/recover", "{}", source.token)[0] == 400
            body = RecoverRequest(
                version=3, holders=[sink2.url], protocol=RecoveryProtocol.TCP
            ).model_dump_json()
            assert _http_error("POST", f"{source.url}/v1/recover", body, source.token) == (
                409,
                "not_a_sink",
            )

            # ---- the recovered sink joins generation 3 as a holder; sink-2 is left out.
            # Its engine serves version 3 already: nothing to recover.
            _apply([source, sink3], 3, port, holders={"sink-3"})
            assert _http_error("POST", f"{sink3.url}/v1/recover", body, sink3.token) == (
                409,
                "not_behind",
            )
            randomize(trainer, seed=104)
            assert publisher.publish(trainer.named_parameters(), version=4).ok
            expect_served(trainer, [sink3.engine], 4)
            assert [_holding(a).version for a in (source, sink2, sink3)] == [4, 3, 4]

            # ---- only a stale holder: the recovery fails, nothing is loaded
            sink4 = _sink(st, 4, delay=KILL_WINDOW_DELAY)
            _recover(sink4, 4, [sink2])
            refused = _finished(sink4)
            assert refused.state == RecoveryState.FAILED
            assert refused.reason == "no_holder"
            assert refused.holders_failed[sink2.url].startswith("version_mismatch")
            assert sink4.engine is not None
            assert sink4.engine.health()["version"] is None

            # ---- a holder dies mid-pull: the other serves the rest
            _recover(sink4, 4, [sink2, sink3, source])

            def pulling() -> bool:
                status = sink4.status().recovery
                return (
                    status is not None
                    and status.state == RecoveryState.RUNNING
                    and (status.bytes > 0)
                )

            eventually(pulling, timeout=RECOVERY_TIMEOUT, interval=0.02, message="pulling")
            # A plan may come meanwhile (its engine restarted in place while it was in a
            # group): it is taken, and the recovery goes on until a round starts.
            accepted = sink4.put_plan(_plan([source, sink4], 4, port, set())[1])
            assert accepted["generation"] == 4
            sink3.proc.popen.send_signal(signal.SIGKILL)
            second = _finished(sink4)
            assert second.state == RecoveryState.DONE, second
            assert second.holders_failed[sink2.url].startswith("version_mismatch")
            assert sink3.url in second.holders_failed, second
            assert source.url in second.holders_used
            expect_served(trainer, [sink4.engine], 4)
            assert sink4.status().version == 4

        metrics = _samples(sink4)
        failures = ("weightsync_recovery_failures_total", (("reason", "no_holder"), *sink_label))
        assert metrics[failures] == 1
        assert metrics[("weightsync_recovery_duration_seconds_count", sink_label)] == 1
        assert metrics[("weightsync_recovery_bandwidth_bytes_per_second", sink_label)] > 0
        assert _samples(source)[("weightsync_held_version", (("role", "source"),))] == 4
