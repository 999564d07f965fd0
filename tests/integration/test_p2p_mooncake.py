"""Pulls through the real Mooncake transfer engine (TCP) from holders in other processes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.integration.p2p_holder import pattern
from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.transfer.broadcast import bucket_checksum
from weightsync.transfer.p2p import (
    Chunk,
    HeldRegion,
    P2PError,
    TransferEngineEndpoint,
    pull,
)

NBYTES = 64 << 20
CHUNK = 1 << 20
SEED = 7


HolderFactory = Callable[..., tuple[HeldRegion, subprocess.Popen[str]]]


@pytest.fixture
def start_holder() -> Iterator[HolderFactory]:
    started: list[subprocess.Popen[str]] = []

    def start(name: str, host: str, seed: int = SEED) -> tuple[HeldRegion, subprocess.Popen[str]]:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.p2p_holder", "--host", host,
             "--nbytes", str(NBYTES), "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        started.append(process)
        assert process.stdout is not None
        line = json.loads(process.stdout.readline())
        return HeldRegion(name, line["segment"], line["address"], line["nbytes"]), process

    yield start
    for process in started:
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.close()  # the holder's signal to let go and exit
        process.wait(timeout=10)
        process.stdout.close()


@pytest.fixture(scope="module")
def puller() -> Iterator[TransferEngineEndpoint]:
    endpoint = TransferEngineEndpoint("127.0.0.9", RecoveryProtocol.TCP)
    yield endpoint
    endpoint.close()


def chunks(expected: torch.Tensor) -> list[Chunk]:
    return [
        Chunk(offset, CHUNK, bucket_checksum(expected[offset : offset + CHUNK]))
        for offset in range(0, NBYTES, CHUNK)
    ]


def test_pull_stripes_over_holders_bit_exact(
    start_holder: HolderFactory, puller: TransferEngineEndpoint
) -> None:
    expected = pattern(NBYTES, SEED)
    holders = [start_holder("a", "127.0.0.11")[0], start_holder("b", "127.0.0.12")[0]]
    destination = torch.zeros(NBYTES, dtype=torch.uint8)
    report = pull(puller, holders, chunks(expected), destination, checksum=bucket_checksum)
    assert torch.equal(destination, expected)
    assert report.bytes == NBYTES
    assert sum(report.bytes_by_holder.values()) == NBYTES
    assert report.failed_holders == {}
    assert all(moved > 0 for moved in report.bytes_by_holder.values()), report.bytes_by_holder


def test_dead_holder_is_dropped_and_the_other_serves_everything(
    start_holder: HolderFactory, puller: TransferEngineEndpoint
) -> None:
    expected = pattern(NBYTES, SEED)
    dead, process = start_holder("dead", "127.0.0.13")
    alive, _ = start_holder("alive", "127.0.0.14")
    process.kill()
    process.wait()
    destination = torch.zeros(NBYTES, dtype=torch.uint8)
    report = pull(puller, [dead, alive], chunks(expected), destination, checksum=bucket_checksum)
    assert torch.equal(destination, expected)
    assert report.bytes_by_holder == {"dead": 0, "alive": NBYTES}
    assert "read_failed" in report.failed_holders["dead"]


def test_holder_with_other_bytes_fails_checksum_and_is_dropped(
    start_holder: HolderFactory, puller: TransferEngineEndpoint
) -> None:
    expected = pattern(NBYTES, SEED)
    corrupt, _ = start_holder("corrupt", "127.0.0.15", seed=SEED + 1)
    good, _ = start_holder("good", "127.0.0.16")
    destination = torch.zeros(NBYTES, dtype=torch.uint8)
    report = pull(puller, [corrupt, good], chunks(expected), destination, checksum=bucket_checksum)
    assert torch.equal(destination, expected)
    assert "checksum_mismatch" in report.failed_holders["corrupt"]


def test_no_live_holder_is_a_clear_error(
    start_holder: HolderFactory, puller: TransferEngineEndpoint
) -> None:
    dead, process = start_holder("dead", "127.0.0.17")
    process.kill()
    process.wait()
    destination = torch.zeros(NBYTES, dtype=torch.uint8)
    with pytest.raises(P2PError, match=r"pulled 0 of \d+ B \(dead: read_failed") as caught:
        pull(puller, [dead], chunks(pattern(NBYTES, SEED)), destination, timeout_seconds=30)
    assert caught.value.reason == "no_live_holder"
