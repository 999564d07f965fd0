"""A trainer pod of two ranks: one sidecar process serving an agent per local rank.

The sidecar runs as the webhook starts it in such a pod (`WEIGHTSYNC_LOCAL_RANKS=0,1`,
a socket template, base ports): it supervises two real agents, each a source rank of
its own with its own socket, ports and member name. Two trainer ranks (threads here:
a Publisher each, finding its socket from its LOCAL_RANK as torchrun sets it) publish
the halves of the reference model they own to a reference engine, which then serves
the whole model bit for bit. When one rank's agent dies, the sidecar stops the other
and exits with an error, so the kubelet restarts the container as a whole.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.stack import AgentProc, free_port, stack, wait_warm
from tests.support.eventually import eventually
from tests.support.plans import local_plan
from weightsync.api import agent_env
from weightsync.api.control import Backend, TransferOptions
from weightsync.client import Publisher, PublishResult
from weightsync.client.connection import agent_socket

pytestmark = pytest.mark.timeout(240)

PRESET = "tiny"


def _free_pair() -> int:
    """A port p with p + 1 free too (local rank i listens on base + i)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two adjacent free ports")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_one_sidecar_serves_each_local_rank_and_they_publish_one_model(tmp_path: Path) -> None:
    from weightsync.reference.memory import tensor_digest
    from weightsync.reference.model import PRESETS, build_model, randomize

    with stack(tmp_path) as st:
        engine = st.start_engine("engine-1", preset=PRESET, seed=0, device="cpu")
        sink = st.start_agent("sink-1", role="sink", device="cpu", engine=engine)
        http, metrics = _free_pair(), _free_pair()
        template = str(tmp_path / "agent-{local_rank}.sock")
        sidecar = st.start_agent(
            "trainer-0",
            role="source",
            device="cpu",
            extra_env={
                agent_env.LOCAL_RANKS: "0,1",
                agent_env.SOCKET: template,
                agent_env.HTTP_PORT: str(http),
                agent_env.METRICS_PORT: str(metrics),
            },
        )
        ranks = [
            AgentProc(sidecar.proc, "source", http + i, metrics + i, st.token, "cpu",
                      Path(template.replace("{local_rank}", str(i))))
            for i in (0, 1)
        ]  # fmt: skip
        st.wait_ready([*ranks, sink], [engine])
        assert [r.status().pod for r in ranks] == ["trainer-0[0]", "trainer-0[1]"]

        pods = ["trainer-0[0]", "trainer-0[1]", "sink-1"]
        transfer = TransferOptions(bucket_size_bytes=64 << 10, timeout_seconds=20.0)
        port = free_port()
        for rank, agent in enumerate([*ranks, sink]):
            agent.put_plan(
                local_plan(pods, rank, generation=1, port=port, backend=Backend.GLOO,
                           transfer=transfer, sources=2)
            )  # fmt: skip
        wait_warm([*ranks, sink], 1, timeout=60.0)

        env = {**os.environ, agent_env.SOCKET: template}
        publishers = [Publisher(agent_socket({**env, "LOCAL_RANK": str(i)})) for i in (0, 1)]
        assert [p.socket_path for p in publishers] == [r.socket_path for r in ranks]
        model = build_model(PRESETS[PRESET], seed=0)
        try:
            with ThreadPoolExecutor(2) as pool:
                for version in (1, 2):
                    randomize(model, seed=version)
                    full = {n: p.detach().clone() for n, p in model.named_parameters()}
                    # Expert-style ownership: each rank holds every other tensor, whole.
                    halves = [
                        {n: t for i, (n, t) in enumerate(full.items()) if i % 2 == rank}
                        for rank in (0, 1)
                    ]
                    futures = [
                        pool.submit(p.publish, halves[i], version=version)
                        for i, p in enumerate(publishers)
                    ]
                    results: list[PublishResult] = [f.result(timeout=60) for f in futures]
                    assert all(r.ok for r in results), results
                    served = engine.digests()
                    assert served["version"] == version
                    assert served["tensors"] == {n: tensor_digest(t) for n, t in full.items()}
        finally:
            for publisher in publishers:
                publisher.close()

        # ---- one rank's agent dies: the sidecar takes the other down and fails
        children = _children(sidecar.proc.popen.pid)
        assert len(children) == 2, children
        victim = next(pid for pid in children if f"{http + 1}" in _environ_port(pid))
        os.kill(victim, signal.SIGKILL)
        code = sidecar.proc.popen.wait(timeout=30)
        assert code != 0
        for pid in children:
            eventually(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _zombie(pid),
                       timeout=15, message=f"agent {pid} stopped")  # fmt: skip
        # The killed agent could not release its slots; the stack knows only the sidecar.
        for leftover in Path("/dev/shm").glob(f"weightsync-{victim}-*"):
            leftover.unlink(missing_ok=True)


def _environ_port(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    prefix = f"{agent_env.HTTP_PORT}=".encode()
    return next((item[len(prefix) :].decode() for item in environ if item.startswith(prefix)), "")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_pod_of_several_ranks_needs_local_rank() -> None:
    template = "/run/agent-{local_rank}.sock"
    assert agent_socket({agent_env.SOCKET: template, "LOCAL_RANK": "3"}) == "/run/agent-3.sock"
    assert agent_socket({agent_env.SOCKET: "/run/a.sock", "LOCAL_RANK": "3"}) == "/run/a.sock"
    from weightsync.client import PublisherError

    with pytest.raises(PublisherError, match="set LOCAL_RANK"):
        agent_socket({agent_env.SOCKET: template})


def test_the_sidecar_refuses_a_bad_rank_list(tmp_path: Path) -> None:
    import subprocess

    env = {
        **os.environ,
        agent_env.ROLE: "source",
        agent_env.LOCAL_RANKS: "0,0",
        "WEIGHTSYNC_TOKEN": "t",
    }
    done = subprocess.run(
        [sys.executable, "-m", "weightsync.agent.main"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "distinct local ranks" in done.stderr
