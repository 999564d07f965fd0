"""Real vLLM and SGLang servers as engine pods on the real node, beside a reference engine,
in one WeightSync: synced bit-exact, then both engine containers killed and recovered.

Each engine runs as a Deployment whose pods get the agent sidecar from the operator's
webhook, exactly as the reference engine's do; the agent drives the server through its
adapter (vLLM's weight-transfer routes with the shared-memory backend plugin, SGLang's
flattened buckets over /dev/shm). The engine containers run the engines' own venvs
(`tests/engines_real/install.py`) mounted read-only from the host into the
reference-engine image (Debian and the libraries Python needs), with the interpreter
they were built with: an image of its own per engine would copy the 3.4 and 7 GB venvs
into layers and import them into the node again (about 21 GB more disk than `make test`
already needs). What runs in the container is the same server, started the same way as
in `tests/engines_real`.

What each engine serves is read from the engine itself: the reference engine's digests,
vLLM's per-tensor checksums (its fused projections excepted) and weight version, SGLang's
weight read-back; greedy output of vLLM and SGLang equals the reference engine's.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cluster.controlplane import LocalCluster
from tests.e2e.test_recovery import answers, in_group, no_tracebacks
from tests.engines_real import install, servers
from tests.support.eventually import eventually
from tests.support.kube import condition
from tests.support.operator import (
    ENGINE_IMAGE,
    ENGINE_PORT,
    TRAINER_PORT,
    OperatorProcess,
    apply,
    engines,
    pods,
    step,
    template,
    trainer,
    trainer_digest,
    weightsync,
)
from tests.support.recovery import engine_digest, http_json, kill_container, pod_logs
from weightsync.reference.memory import tensor_digest
from weightsync.reference.model import build_model

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.timeout(1500)]

REAL = ("vllm", "sglang")
MODEL_MOUNT = "/model"
# Startup took 42-67 s (vLLM) and 17-37 s (SGLang) as processes on 2 shared cores; as
# pods beside the rest of the stack, on a loaded CI machine, give each several times that.
ENGINES_UP = 480.0
ROUND_UP = 180.0
PROMPT = [5, 6, 7, 8, 9]
EMPTY = tensor_digest(torch.empty(0))  # what vLLM's checksum gives a fused projection
SHAPES = {name: p.shape for name, p in build_model(servers.MODEL, seed=0).named_parameters()}


def interpreter_prefix(python: Path) -> Path:
    """The installation the venv's interpreter links to (its `pyvenv.cfg` home's parent)."""
    config = configparser.ConfigParser()
    config.read_string("[venv]\n" + (python.parent.parent / "pyvenv.cfg").read_text())
    return Path(config["venv"]["home"]).parent


def real_engine(name: str, python: Path, model: Path) -> dict[str, Any]:
    """A Deployment of one `name` server on the real node, its venv mounted from the host."""
    venv, prefix = python.parent.parent, interpreter_prefix(python)
    mount = Path(MODEL_MOUNT)
    if name == "vllm":
        command = servers.vllm_command(python, mount, ENGINE_PORT, host="0.0.0.0")
        env = servers.VLLM_ENV
    else:
        command = servers.sglang_command(python, mount, ENGINE_PORT, host="0.0.0.0")
        env = servers.SGLANG_ENV
    host_dirs = {"venv": venv, "interpreter": prefix, "model": model}
    container = {
        "name": "engine",
        "image": ENGINE_IMAGE,
        "imagePullPolicy": "Never",
        "command": command,
        # Caches (vLLM's, torch's, Hugging Face's) go to a writable place.
        "env": [{"name": k, "value": v} for k, v in {**env, "HOME": "/tmp"}.items()],
        # The venvs live under root's home on the host (mode 700).
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False},
        "volumeMounts": [
            {"name": "venv", "mountPath": str(venv), "readOnly": True},
            {"name": "interpreter", "mountPath": str(prefix), "readOnly": True},
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
        ],
        "readinessProbe": {"httpGet": {"path": "/health", "port": ENGINE_PORT},
                           "periodSeconds": 2, "timeoutSeconds": 5},
    }  # fmt: skip
    pod = template(name, [container], inject=True, local=True)
    pod["spec"]["volumes"] = [
        {"name": key, "hostPath": {"path": str(path), "type": "Directory"}}
        for key, path in host_dirs.items()
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": pod},
    }


def the_pod(cluster: LocalCluster, namespace: str, app: str) -> dict[str, Any]:
    (pod,) = pods(cluster, namespace, app)
    return pod


def url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{ENGINE_PORT}"


def reference_output(cluster: LocalCluster, namespace: str) -> tuple[list[int], int]:
    body = http_post(url(the_pod(cluster, namespace, "engine")) + "/generate",
                     {"input_ids": [PROMPT], "max_new_tokens": 8})  # fmt: skip
    return body["output_ids"][0], body["weight_version"]


def http_post(address: str, body: Any) -> Any:
    request = urllib.request.Request(  # noqa: S310 - pod addresses
        address, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:  # noqa: S310
        return json.loads(reply.read())


def vllm_serves(address: str, expected: dict[str, Any], tokens: list[int]) -> None:
    sums = http_post(f"{address}/weight_checker", {"action": "checksum"})["checksums"]
    served = {key.rsplit(":", 1)[-1]: value for key, value in sums.items()}
    fused = {name for name, value in served.items() if value == EMPTY}
    assert all(name.endswith("_proj.weight") for name in fused), sorted(fused)
    kept = {name: served[name] for name in set(served) - fused}
    assert kept == {name: expected["tensors"][name] for name in kept}
    assert len(kept) == 7  # embed_tokens, 2 x 2 layer norms, norm, lm_head
    assert http_json("GET", f"{address}/weight_info") == {
        "weight_version": str(expected["version"])
    }
    reply = http_post(f"{address}/v1/completions", {
        "model": "model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    })  # fmt: skip
    assert reply["choices"][0]["token_ids"] == tokens


def sglang_serves(address: str, expected: dict[str, Any], tokens: list[int]) -> None:
    for name, shape in SHAPES.items():
        values = http_post(f"{address}/get_weights_by_name",
                           {"name": name, "truncate_size": shape[0]})  # fmt: skip
        read = torch.tensor(values, dtype=torch.float32).reshape(shape)
        assert tensor_digest(read) == expected["tensors"][name], name
    reply = http_post(f"{address}/generate", {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    })  # fmt: skip
    # Seen once (2026-11-28): 5 of 8 tokens; the meta shows how SGLang ended the request.
    assert reply["output_ids"] == tokens, reply["meta_info"]
    assert reply["meta_info"]["weight_version"] == str(expected["version"])


CHECKS: dict[str, Callable[[str, dict[str, Any], list[int]], None]] = {
    "vllm": vllm_serves,
    "sglang": sglang_serves,
}


def all_serve(cluster: LocalCluster, namespace: str, trainer_ip: str) -> int:
    """Every engine serves exactly the trainer's weights (its digests, read now); the
    version they serve."""
    expected = trainer_digest(trainer_ip)
    assert engine_digest(the_pod(cluster, namespace, "engine"), ENGINE_PORT) == expected
    tokens, version = reference_output(cluster, namespace)
    assert version == expected["version"]
    for app in REAL:
        CHECKS[app](url(the_pod(cluster, namespace, app)), expected, tokens)
    served: int = expected["version"]
    return served


def gates_open(cluster: LocalCluster, namespace: str) -> bool:
    return all(
        condition(the_pod(cluster, namespace, app), "Ready") == "True" for app in ("engine", *REAL)
    )


def restarted_and_ready(
    cluster: LocalCluster, namespace: str, app: str, attempt: int
) -> dict[str, Any] | None:
    pod = the_pod(cluster, namespace, app)
    restarts = {c["name"]: c["restartCount"] for c in pod["status"]["containerStatuses"]}
    return pod if restarts["engine"] > attempt and condition(pod, "Ready") == "True" else None


@contextlib.contextmanager
def logs_on_failure(cluster: LocalCluster, namespace: str, keep: Path) -> Iterator[None]:
    """A failure here is read from the servers' own logs: their tails go to stderr, the
    whole logs to `keep` (the node's copies go with the cluster)."""
    try:
        yield
    except BaseException:
        for name, text in sorted(pod_logs(cluster, namespace).items()):
            sys.stderr.write(f"\n--- {name} (tail) ---\n{text[-4000:]}\n")
            path = keep / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        sys.stderr.write(f"\nwhole logs: {keep}\n")
        raise


def test_vllm_and_sglang_pods_sync_bit_exact_and_recover_from_a_restart(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    with logs_on_failure(cluster, namespace, tmp_path / "logs"):
        model = servers.write_model(tmp_path / "model")
        pythons = {name: install.install(install.ENGINES[name]) for name in REAL}
        sync = weightsync()
        sync["spec"]["inference"] += [
            {"deploymentRef": {"name": "vllm"}, "engine": "VLLM", "port": ENGINE_PORT},
            {"deploymentRef": {"name": "sglang"}, "engine": "SGLang", "port": ENGINE_PORT},
        ]
        sync["spec"]["recovery"] = {"protocol": "TCP", "holders": 1}
        sync["spec"]["transfer"]["timeoutSeconds"] = 60  # CPU servers load slowly
        apply(
            cluster, namespace,
            trainer(preset=servers.PRESET), engines(replicas=1, preset=servers.PRESET),
            *(real_engine(name, pythons[name], model) for name in REAL), sync,
        )  # fmt: skip
        eventually(
            lambda: in_group(cluster, namespace, 4), timeout=ENGINES_UP, message="4 ranks warm"
        )
        trainer_ip: str = the_pod(cluster, namespace, "trainer")["status"]["podIP"]
        eventually(lambda: answers(f"http://{trainer_ip}:{TRAINER_PORT}/digest"),
                   timeout=ROUND_UP, message="trainer serving")  # fmt: skip

        for _ in range(2):
            report = step(trainer_ip)
            assert report["ok"], report
            eventually(lambda: gates_open(cluster, namespace), timeout=ROUND_UP, message="Ready")
            assert all_serve(cluster, namespace, trainer_ip) == report["version"]

        # Both real engines killed at once: two recoveries from the one holder together,
        # and one engine restart's wait (a minute or more here) instead of two.
        victims = {app: the_pod(cluster, namespace, app) for app in REAL}
        attempts = {app: kill_container(cluster.node, p, "engine") for app, p in victims.items()}
        for app, victim in victims.items():
            pod = eventually(lambda a=app: restarted_and_ready(cluster, namespace, a, attempts[a]),
                             timeout=ENGINES_UP, message=f"{app} restarted and Ready")  # fmt: skip
            assert pod["status"]["podIP"] == victim["status"]["podIP"]  # in place
        # Recovered from the holder, no round: they serve the current version, whole.
        all_serve(cluster, namespace, trainer_ip)
        report = step(trainer_ip)
        assert report["ok"], report
        eventually(lambda: gates_open(cluster, namespace), timeout=ROUND_UP, message="Ready")
        assert all_serve(cluster, namespace, trainer_ip) == report["version"]
        no_tracebacks(cluster, operator, namespace)
