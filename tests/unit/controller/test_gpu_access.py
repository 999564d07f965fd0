"""The sidecar's GPUs (its workload's ResourceClaims, never a device plugin's GPU) and what a
WeightSync and the chart add to it for the fabric (`spec.agent`, `agent.env`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.controller.builders import pod, sync
from tests.unit.controller.test_injection import agent_of, env_of, inject
from weightsync.api.v1alpha1 import Role
from weightsync.controller import names
from weightsync.controller.admission.gpu_access import GpusNotShareableError, gpu_access
from weightsync.controller.admission.injection import injection_patch
from weightsync.controller.admission.sidecar import AgentTemplate

CLAIMED = [{"name": "gpus", "resourceClaimTemplateName": "one-gpu"}, {"name": "nic"}]


def engine_pod(*containers: dict[str, Any]) -> dict[str, Any]:
    return (
        pod("engine-a-abc-x1")
        .set("spec.resourceClaims", CLAIMED)
        .set("spec.containers", list(containers))
        .build()
    )


def test_the_sidecar_shares_its_workloads_claims_and_uses_their_first_gpu() -> None:
    raw = engine_pod(
        {"name": "engine", "resources": {"claims": [{"name": "gpus"}]}},
        {"name": "proxy", "resources": {"claims": [{"name": "gpus"}, {"name": "nic"}]}},
    )
    _, patched = inject(raw, Role.SINK, spec__readinessGate={"enabled": False})
    agent = agent_of(patched)
    assert agent["resources"]["claims"] == [{"name": "gpus"}, {"name": "nic"}]  # once each
    assert "nvidia.com/gpu" not in agent["resources"].get("limits", {})
    assert env_of(agent)["WEIGHTSYNC_DEVICE"] == "cuda:0"
    assert patched["metadata"]["annotations"][names.AGENT_DEVICE_ANNOTATION] == "cuda:0"
    assert "readinessGates" not in patched["spec"]


def test_a_device_plugin_gpu_cannot_reach_the_sidecar_and_the_pod_is_refused() -> None:
    raw = (
        pod("engine-a-abc-x1")
        .set(
            "spec.containers", [{"name": "vllm", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]
        )
        .build()
    )
    with pytest.raises(GpusNotShareableError) as refused:
        inject(raw, Role.SINK)
    message = str(refused.value)
    assert "container 'vllm' gets its GPUs from a device plugin (nvidia.com/gpu: 2)" in message
    assert "ResourceClaim" in message
    # Claims beside a device plugin's GPU: the claims are what the sidecar shares.
    raw["spec"]["resourceClaims"] = CLAIMED[:1]
    raw["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus"}]
    assert gpu_access(raw).device == "cuda:0"


def test_a_pod_without_gpus_gets_a_cpu_agent_and_the_claims_its_weightsync_adds() -> None:
    raw = pod("engine-a-abc-x1").set("spec.resourceClaims", CLAIMED).build()
    _, patched = inject(raw, Role.SINK, spec__agent={"claims": ["nic"]})
    agent = agent_of(patched)
    assert env_of(agent)["WEIGHTSYNC_DEVICE"] == "cpu"
    assert agent["resources"]["claims"] == [{"name": "nic"}]


def test_the_sidecar_meets_pod_security_restricted_unless_ipc_lock_is_asked_for() -> None:
    _, patched = inject(pod("engine-a-abc-x1").build(), Role.SINK)
    agent = agent_of(patched)
    assert agent["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert agent["terminationMessagePolicy"] == "FallbackToLogsOnError"
    _, patched = inject(pod("engine-a-abc-x1").build(), Role.SINK, spec__agent={"ipcLock": True})
    assert agent_of(patched)["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["IPC_LOCK"],
    }


def test_fabric_settings_come_after_the_operators_and_never_replace_them() -> None:
    template = AgentTemplate(
        image="agent:1",
        requests={"cpu": "500m", "memory": "1Gi"},
        env=({"name": "NCCL_IB_HCA", "value": "mlx5_0"}, {"name": "NCCL_DEBUG", "value": "WARN"}),
    )
    spec = sync(
        spec__agent={
            "env": [{"name": "NCCL_IB_HCA", "value": "mlx5_1,mlx5_2"}],
            "resources": {"requests": {"memory": "64Gi"}, "limits": {"rdma/ib": "1"}},
            "volumeMounts": [{"name": "infiniband", "mountPath": "/dev/infiniband"}],
        }
    )
    ops = injection_patch(
        pod("engine-a-abc-x1").build(), sync=spec, role=Role.SINK, inference_index=0,
        namespace="ns", template=template,
    )  # fmt: skip
    agent = next(op["value"][0] for op in ops if op["path"] == "/spec/initContainers")
    env = env_of(agent)
    assert env["NCCL_IB_HCA"] == "mlx5_1,mlx5_2"  # the WeightSync's, after the chart's
    assert env["NCCL_DEBUG"] == "WARN"
    assert [e["name"] for e in agent["env"]].count("NCCL_IB_HCA") == 1
    assert env["WEIGHTSYNC_ROLE"] == "sink"
    assert agent["resources"] == {
        "requests": {"cpu": "500m", "memory": "64Gi"},
        "limits": {"rdma/ib": "1"},
    }
    assert {"name": "infiniband", "mountPath": "/dev/infiniband", "readOnly": False} in agent[
        "volumeMounts"
    ]


@pytest.mark.parametrize(
    ("agent", "error"),
    [
        ({"env": [{"name": "WEIGHTSYNC_DEVICE", "value": "cuda:3"}]}, "operator's settings"),
        ({"resources": {"limits": {"nvidia.com/gpu": "1"}}}, "no GPU of its own"),
        ({"resources": {"requests": {"memory": "lots"}}}, "String should match pattern"),
        ({"capabilities": ["SYS_ADMIN"]}, "Extra inputs are not permitted"),
    ],
)
def test_what_a_weightsync_may_not_add_to_the_sidecar_is_refused_with_its_path(
    agent: dict[str, Any], error: str
) -> None:
    from weightsync.api.validation import WeightSyncInvalidError

    with pytest.raises(WeightSyncInvalidError) as refused:
        sync(spec__agent=agent)
    assert "spec.agent." in str(refused.value)
    assert error in str(refused.value)
