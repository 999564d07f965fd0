"""Real processes for data-plane tests: reference engines and agents on 127.0.0.1.

The test plays the operator (PUT /v1/plan, GET /v1/status) and the trainer (Publisher).
Nothing here is mocked: every agent and engine is its own Python process, and the
group is a real gloo (or NCCL) process group.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.eventually import eventually
from tests.support.ports import free_port
from weightsync.api.control import AgentStatus, MembershipPlan

STARTUP_TIMEOUT = 120.0  # seven Python processes importing torch on two busy cores


def http_json(
    method: str, url: str, body: str | None = None, token: str | None = None, timeout: float = 10
) -> Any:
    data = body.encode() if body else None
    request = urllib.request.Request(url, method=method, data=data)  # noqa: S310 - our own URL
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - our own URL
        return json.loads(response.read())


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Engine:
    proc: Proc
    port: int
    argv: list[str] = field(default_factory=list)  # how it was started (to restart it)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = http_json("GET", f"{self.url}/health")
        return body

    def digests(self, timeout: float = 10) -> dict[str, Any]:
        """Every tensor's sha256 (about 1 s a GB of weights: a large model needs a longer
        `timeout`)."""
        body: dict[str, Any] = http_json("GET", f"{self.url}/v1/weights/digest", timeout=timeout)
        return body

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
        payload = json.dumps({"input_ids": prompts, "max_new_tokens": max_new_tokens})
        body: dict[str, Any] = http_json("POST", f"{self.url}/generate", payload)
        return body


@dataclass
class AgentProc:
    proc: Proc
    role: str
    http_port: int
    metrics_port: int
    token: str
    device: str
    socket_path: Path | None = None
    engine: Engine | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def put_plan(self, plan: MembershipPlan) -> dict[str, Any]:
        body: dict[str, Any] = http_json(
            "PUT", f"{self.url}/v1/plan", plan.model_dump_json(), self.token
        )
        return body

    def status(self) -> AgentStatus:
        return AgentStatus.model_validate(
            http_json("GET", f"{self.url}/v1/status", None, self.token)
        )

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text: str = response.read().decode()
            return text


@dataclass
class Stack:
    """Processes started by one test; `close` ends every one of them (and only them)."""

    workdir: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: list[Proc] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)  # extra reference-engine flags

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        log = self.workdir / f"{name}.log"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
        handle = log.open("wb")
        popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=full_env)
        handle.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def start_engine(
        self,
        name: str,
        *,
        preset: str,
        seed: int,
        device: str,
        load_delay_seconds: float = 0.0,
        tp: int = 1,
        kv_cache_bytes: int = 0,
    ) -> Engine:
        """A reference engine; `load_delay_seconds` slows each bucket's load so a test can
        act while a round or a recovery runs; `tp` workers from `device` on; a KV-cache
        reserve of `kv_cache_bytes`."""
        port = free_port()
        argv = [
            sys.executable, "-m", "weightsync.reference.server",
            "--port", str(port), "--preset", preset, "--seed", str(seed), "--device", device,
            "--load-delay-seconds", str(load_delay_seconds), "--tp", str(tp),
            "--kv-cache-bytes", str(kv_cache_bytes), *self.engine_args,
        ]  # fmt: skip
        return Engine(self._spawn(name, argv, {}), port, argv)

    def restart_engine(self, engine: Engine, *, seed: int) -> None:
        """Kill the engine and start it again at the same address with other weights, as a
        kubelet restarts a crashed container in place."""
        engine.proc.kill()
        argv = list(engine.argv)
        argv[argv.index("--seed") + 1] = str(seed)
        engine.proc = self._spawn(engine.proc.name, argv, {})
        eventually(engine.health, timeout=STARTUP_TIMEOUT, interval=0.2, message="engine back")

    def start_agent(
        self,
        name: str,
        *,
        role: str,
        device: str,
        engine: Engine | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> AgentProc:
        http_port, metrics_port = free_port(), free_port()
        env = {
            "WEIGHTSYNC_ROLE": role,
            "WEIGHTSYNC_POD_NAME": name,
            "WEIGHTSYNC_HTTP_HOST": "127.0.0.1",
            "WEIGHTSYNC_HTTP_PORT": str(http_port),
            "WEIGHTSYNC_METRICS_PORT": str(metrics_port),
            "WEIGHTSYNC_TOKEN": self.token,
            "WEIGHTSYNC_DEVICE": device,
            **(extra_env or {}),
        }
        socket_path = None
        if role == "source" and "WEIGHTSYNC_SOCKET" not in env:
            socket_path = self.workdir / f"{name}.sock"
            env["WEIGHTSYNC_SOCKET"] = str(socket_path)
        if engine is not None:
            env["WEIGHTSYNC_ENGINE"] = "Reference"
            env["WEIGHTSYNC_ENGINE_URL"] = engine.url
        argv = [sys.executable, "-m", "weightsync.agent.main"]
        proc = self._spawn(name, argv, env)
        return AgentProc(
            proc, role, http_port, metrics_port, self.token, device, socket_path, engine
        )

    def wait_ready(self, agents: list[AgentProc], engines: list[Engine]) -> None:
        def up() -> bool:
            for proc in self.procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            for engine in engines:
                engine.health()
            for agent in agents:
                agent.status()
            return True

        eventually(up, timeout=STARTUP_TIMEOUT, interval=0.2, message="agents and engines up")

    def logs(self) -> str:
        return "\n".join(f"----- {p.name}\n{p.tail()}" for p in self.procs)

    def close(self) -> None:
        for proc in self.procs:  # all at once: each takes a moment to shut down
            if proc.alive():
                proc.popen.terminate()
        for proc in self.procs:
            proc.stop()
            # A process killed, or stopped in a round, leaves its shared-memory slots.
            for leftover in Path("/dev/shm").glob(f"weightsync-{proc.popen.pid}-*"):
                leftover.unlink(missing_ok=True)


@contextmanager
def stack(workdir: Path) -> Iterator[Stack]:
    running = Stack(workdir)
    try:
        yield running
    except BaseException:
        sys.stderr.write(running.logs())
        raise
    finally:
        running.close()


def wait_warm(agents: list[AgentProc], generation: int, timeout: float) -> None:
    def warm() -> bool:
        for agent in agents:
            states = {g.generation: g for g in agent.status().generations}
            state = states.get(generation)
            if state is None or state.state.value not in ("warm", "active"):
                if state is not None and state.state.value == "broken":
                    raise RuntimeError(f"{agent.proc.name}: generation broke: {state.error}")
                return False
        return True

    eventually(warm, timeout=timeout, interval=0.1, message=f"generation {generation} warm")


__all__ = ["AgentProc", "Engine", "Stack", "free_port", "stack", "wait_warm"]
