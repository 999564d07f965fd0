"""docs/examples/vllm-tp, the walkthrough of docs/real-cluster.md, as the webhook sees it.

The manifests a user applies (claims, trainer, vLLM engine, WeightSync) are valid, and
the injection the webhook performs on their pod templates gives each sidecar what the
page says: the workload's claim, the trainer's two ranks, the engine on loopback behind
the front. The API server's own check of the same files is in
tests/cluster/test_weightsync_crd.py (server-side dry run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonpatch
import yaml

from weightsync.api import agent_env, parse_weightsync
from weightsync.api.engines import VLLM_INJECTION
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names
from weightsync.controller.admission.injection import injection_patch
from weightsync.controller.admission.sidecar import AgentTemplate
from weightsync.controller.membership.trainer_ranks import served_ranks

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "vllm-tp"
PAGE = Path(__file__).resolve().parents[3] / "docs" / "real-cluster.md"
TEMPLATE = AgentTemplate(image="agent:1", requests={}, limits={})


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(EXAMPLE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def _pod(workload: dict[str, Any], name: str) -> dict[str, Any]:
    template = workload["spec"]["template"]
    return {"metadata": {**template["metadata"], "name": name}, "spec": template["spec"]}


def _inject(pod: dict[str, Any], role: Role, **kwargs: Any) -> dict[str, Any]:
    sync = parse_weightsync(_objects()[("WeightSync", "qwen3-8b-tp")])
    ops = injection_patch(pod, sync=sync, role=role, namespace="ns", template=TEMPLATE, **kwargs)
    patched: dict[str, Any] = jsonpatch.JsonPatch(ops).apply(pod)
    return patched


def _agent(pod: dict[str, Any]) -> dict[str, Any]:
    (agent,) = [c for c in pod["spec"]["initContainers"] if c["name"] == names.AGENT_CONTAINER]
    return agent


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_page_walks_through_every_file_of_the_example() -> None:
    page = PAGE.read_text()
    for path in sorted(EXAMPLE.glob("*.yaml")):
        assert f"docs/examples/vllm-tp/{path.name}" in page, path.name


def test_the_weightsync_names_the_example_workloads_and_ranks() -> None:
    objects = _objects()
    sync = parse_weightsync(objects[("WeightSync", "qwen3-8b-tp")])
    trainer = objects[("StatefulSet", sync.spec.trainer.stateful_set_ref.name)]
    (entry,) = sync.spec.inference
    engine = objects[("Deployment", entry.deployment_ref.name)]
    claim = objects[("ResourceClaimTemplate", "two-gpus")]
    (request,) = claim["spec"]["spec"]["devices"]["requests"]
    gpus = request["exactly"]["count"]
    assert sync.spec.trainer.ranks_per_pod == gpus
    assert (
        f"--nproc-per-node={gpus}"
        in trainer["spec"]["template"]["spec"]["containers"][0]["command"]
    )
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    assert f"--tensor-parallel-size={gpus}" in container["args"]
    assert "--host=127.0.0.1" in container["args"]
    assert f"--port={entry.port}" in container["args"]
    assert entry.front is not None
    assert container["readinessProbe"]["httpGet"]["port"] == entry.front.port
    service = objects[("Service", entry.deployment_ref.name)]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [entry.front.port]


def test_the_engine_sidecar_shares_the_claim_and_fronts_the_loopback_engine() -> None:
    engine = _objects()[("Deployment", "qwen3-8b-vllm")]
    patched = _inject(_pod(engine, "qwen3-8b-vllm-abc-x1"), Role.SINK, inference_index=0)
    agent = _agent(patched)
    assert agent["resources"]["claims"] == [{"name": "gpus"}]
    env = _env(agent)
    assert env[agent_env.ENGINE_URL] == "http://127.0.0.1:8000"
    assert env[agent_env.FRONT_PORT] == "8001"
    assert env[agent_env.DEVICE] == "cuda:0"  # the first of the claim's; copies on the rest
    assert agent_env.ENGINE_DEVICES not in env  # every GPU the claim gives it
    assert {"name": names.FRONT_PORT_NAME, "containerPort": 8001, "protocol": "TCP"} in agent[
        "ports"
    ]
    security = agent["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    (container,) = patched["spec"]["containers"]
    injected = _env(container)
    for name, value in VLLM_INJECTION.env.items():
        assert injected[name] == value
    gates = [g["conditionType"] for g in patched["spec"]["readinessGates"]]
    assert names.WEIGHTS_CURRENT in gates


def test_the_trainer_sidecar_serves_both_ranks_on_the_shared_claim() -> None:
    objects = _objects()
    sync = parse_weightsync(objects[("WeightSync", "qwen3-8b-tp")])
    trainer = objects[("StatefulSet", "qwen3-8b-trainer")]
    patched = _inject(
        _pod(trainer, "qwen3-8b-trainer-0"), Role.SOURCE, inference_index=None,
        served=served_ranks(sync, 0),
    )  # fmt: skip
    agent = _agent(patched)
    assert agent["resources"]["claims"] == [{"name": "gpus"}]
    assert _env(agent)[agent_env.LOCAL_RANKS] == "0,1"
    annotations = patched["metadata"]["annotations"]
    assert annotations[names.RANKS_PER_POD_ANNOTATION] == "2"
