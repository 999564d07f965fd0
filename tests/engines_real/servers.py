"""Real vLLM and SGLang servers for the engine tests: a tiny model made offline, started
from the engines' own venvs (`install.py`), stopped with everything they spawned.

The model is Llama-shaped, float32, built from a config: `config.json`, a word-level
tokenizer over printable ASCII written as `tokenizer.json`, and no weights (the servers
start with `--load-format dummy`; weights arrive through weightsync). Its parameter
names and maths are those of weightsync's reference model, which computes the expected
greedy outputs. Head size 32: vLLM's CPU attention needs at least 32.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from weightsync.reference.model import PRESETS, ModelConfig

# Vocabulary 256, a multiple of 64: neither engine pads the embedding. Head size 32.
PRESET = "tiny-hd32"
MODEL = PRESETS[PRESET]
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# Startup took 42-67 s (vLLM) and 17-37 s (SGLang) on 2 shared cores; the bound is for a
# loaded CI machine.
START_TIMEOUT_SECONDS = 240.0
STOP_TIMEOUT_SECONDS = 30.0
SHM = Path("/dev/shm")
# What a killed server leaves in /dev/shm: torch's file-system sharing (psm_*, made through
# torch_shm_manager, which dies with the group) and SGLang's weight loads.
LEFT_BY_SERVERS = ("psm_*", "sglang_*")


def write_model(directory: Path, config: ModelConfig = MODEL) -> Path:
    """A Hugging Face model directory without weights: config and tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(hf_config, indent=1))
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    while len(vocab) < config.vocab_size:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": index,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for index, token in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        # One token per character, joined back without separators.
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": "."},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 512,
            }
        )
    )
    return directory


def vllm_command(python: Path, model: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "model",
        "--host",
        host,
        "--port",
        str(port),
        # bf16 hits an illegal instruction in the CPU attention kernel on these machines.
        "--dtype",
        "float32",
        "--load-format",
        "dummy",
        "--weight-transfer-config",
        json.dumps({"backend": "weightsync_shm"}),
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "8",
        "--enforce-eager",
        "--seed",
        "0",
    ]


VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # mounts the weight-transfer routes
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the machine's cores are shared with CI
    "VLLM_LOGGING_LEVEL": "INFO",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}


def sglang_command(python: Path, model: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    return [
        str(python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--dtype",
        "float32",
        "--load-format",
        "dummy",
        "--context-length",
        "256",
        "--max-running-requests",
        "8",
        # The KV pool is sized by tokens (about 1 KiB each here); the fraction only has to
        # leave SGLang's memory check room on a machine whose free memory varies.
        "--mem-fraction-static",
        "0.5",
        "--max-total-tokens",
        "16384",
        "--disable-cuda-graph",
        "--random-seed",
        "0",
    ]


SGLANG_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGL_CPU_OMP_THREADS_BIND": "all",
}


@dataclass
class EngineServer:
    """A running engine server: its base URL, process and log."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    shm_before: set[str] = field(default_factory=set)  # /dev/shm names before it started

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server and every process it started (its own process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        sweep_shm(self.shm_before)

    def stop(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        # Workers outlive a parent that exits first: clear the whole group either way.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        sweep_shm(self.shm_before)


def shm_names() -> set[str]:
    return {path.name for pattern in LEFT_BY_SERVERS for path in SHM.glob(pattern)}


def _shm_in_use() -> set[str]:
    """/dev/shm names that a live process has open or mapped."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for line in (proc / "maps").read_text().splitlines():
                _, found, rest = line.partition("/dev/shm/")
                if found:
                    used.add(rest.split(" ")[0])
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    _, found, rest = os.readlink(fd).partition("/dev/shm/")
                    if found:
                        used.add(rest.split(" ")[0])
    return used


def sweep_shm(before: set[str]) -> None:
    """Remove what the servers left in /dev/shm since `before` and nothing alive uses
    (about 400 MB per run of the engine tests before this)."""
    for name in shm_names() - before - _shm_in_use():
        (SHM / name).unlink(missing_ok=True)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:  # noqa: S310 - loopback
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_server(
    name: str, command: Sequence[str], env: dict[str, str], port: int, log: Path
) -> EngineServer:
    """Start a server in a process group of its own and wait until /health answers 200."""
    environment = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    # weightsync's venv must not leak into the engine's interpreter.
    for variable in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        environment.pop(variable, None)
    log.parent.mkdir(parents=True, exist_ok=True)
    before = shm_names()
    with log.open("wb") as out:
        process = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,
        )
    server = EngineServer(
        name=name, url=f"http://127.0.0.1:{port}", process=process, log=log, shm_before=before
    )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{server.log_tail()}")
        if _ready(server.url):
            return server
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"{name} not ready in {START_TIMEOUT_SECONDS:g} s:\n{server.log_tail()}")


@contextlib.contextmanager
def running(
    name: str, command: Sequence[str], env: dict[str, str], port: int, log: Path
) -> Iterator[EngineServer]:
    server = start_server(name, command, env, port, log)
    try:
        yield server
    finally:
        server.stop()
