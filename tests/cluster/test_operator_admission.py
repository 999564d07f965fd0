"""The operator's webhooks and reports when things are missing, taken, or down.

KWOK plays every pod here (no processes): admission, scheduling and status are what is
tested, so these tests are quick.
"""

from __future__ import annotations

import signal
import time
from datetime import UTC, datetime, timedelta

import pytest
import yaml

from tests.support.eventually import Timeouts, eventually
from tests.support.operator import (
    OperatorProcess,
    apply,
    engines,
    events,
    get,
    has_sidecar,
    pods,
    ready,
    reason,
    sync_status,
    trainer,
    weightsync,
)
from weightsync.api import reasons
from weightsync.controller import names
from weightsync.controller.membership.workloads import parse_time
from weightsync.controller.runtime.timing import WORKLOAD_GRACE_SECONDS

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(300)
def test_unrelated_pods_are_never_mutated_and_schedule_while_the_operator_is_down(
    operator: OperatorProcess, namespace: str
) -> None:
    cluster = operator.cluster
    # KWOK plays these pods (no processes): admission and scheduling are what is tested.
    apply(cluster, namespace, weightsync(), trainer(local=False))
    apply(cluster, namespace, engines("plain", replicas=1, inject=False, local=False))
    (plain,) = eventually(
        lambda: ready(cluster, namespace, "plain", 1), timeout=Timeouts.POD_READY, message="plain"
    )
    assert not has_sidecar(plain)
    assert not any(k.startswith("weightsync.io/") for k in plain["metadata"].get("annotations", {}))
    assert "readinessGates" not in plain["spec"]
    assert has_sidecar(pods(cluster, namespace, "trainer")[0])

    # Pods from the WeightSync's own second count as applied together with it (and would
    # be recreated); the pods below must be clearly newer.
    created = parse_time(
        get(cluster, namespace, "weightsync", "sync")["metadata"]["creationTimestamp"]
    )
    assert created is not None
    eventually(
        lambda: datetime.now(UTC) >= created + timedelta(seconds=1.2),
        timeout=Timeouts.API, message="a second past the WeightSync",
    )  # fmt: skip

    # A hard kill leaves the webhooks registered, pointing at nothing.
    operator.stop(signal.SIGKILL)
    (pod_hook,) = get(cluster, "default", "mutatingwebhookconfiguration", operator.configuration)[
        "webhooks"
    ]
    assert pod_hook["failurePolicy"] == "Ignore"
    assert pod_hook["objectSelector"] == {
        "matchExpressions": [
            {"key": names.INJECT_LABEL, "operator": "In", "values": [names.INJECT_VALUE]}
        ]
    }
    assert pod_hook["rules"][0]["operations"] == ["CREATE"]
    (claims_hook,) = get(
        cluster, "default", "validatingwebhookconfiguration", operator.configuration
    )["webhooks"]
    assert claims_hook["failurePolicy"] == "Fail"
    assert claims_hook["rules"][0]["resources"] == ["weightsyncs"]
    started = time.monotonic()
    apply(
        cluster,
        namespace,
        engines("plain-2", replicas=1, inject=False, local=False),
        engines("engine", replicas=1, inject=True, local=False),
    )
    (unrelated,) = eventually(
        lambda: ready(cluster, namespace, "plain-2", 1),
        timeout=Timeouts.POD_READY,
        message="plain-2",
    )
    # The API server never called the dead webhook for it: no 30 s admission timeout.
    assert time.monotonic() - started < 20
    assert not has_sidecar(unrelated)
    # A labelled pod is admitted too (failurePolicy Ignore), without the sidecar...
    (bare,) = eventually(
        lambda: ready(cluster, namespace, "engine", 1), timeout=Timeouts.POD_READY, message="engine"
    )
    assert not has_sidecar(bare)

    # ...and once the operator is back, the WeightSync says so.
    operator.start()

    def flagged() -> bool:
        degraded = reason(sync_status(cluster, namespace), "Degraded")
        return degraded == ("True", "SidecarMissing")

    eventually(flagged, timeout=Timeouts.API, message="Degraded=True SidecarMissing")
    degraded = next(
        c for c in sync_status(cluster, namespace)["conditions"] if c["type"] == "Degraded"
    )
    assert bare["metadata"]["name"] in degraded["message"]
    assert ("Warning", "SidecarMissing") in events(cluster, namespace)
    assert "Traceback" not in operator.output()


@pytest.mark.timeout(180)
def test_invalid_references_and_claimed_workloads_are_reported_not_crashed_on(
    operator: OperatorProcess, namespace: str
) -> None:
    cluster = operator.cluster
    apply(cluster, namespace, weightsync())

    def ready_reason() -> str | None:
        found = reason(sync_status(cluster, namespace), "Ready")
        return found[1] if found and found[0] == "False" else None

    # Moments after its creation a missing workload is pending (it may come with the
    # same apply), then, still missing after the grace, the user's error.
    assert eventually(ready_reason, timeout=Timeouts.API) == reasons.WORKLOAD_PENDING
    eventually(
        lambda: ready_reason() == reasons.TRAINER_NOT_FOUND,
        timeout=Timeouts.API + WORKLOAD_GRACE_SECONDS, message="Ready=False TrainerNotFound",
    )  # fmt: skip
    # Level-based: creating the StatefulSet moves the reason on without touching the spec.
    apply(cluster, namespace, trainer(inject=False, local=False))
    eventually(
        lambda: ready_reason() == reasons.DEPLOYMENT_NOT_FOUND,
        timeout=Timeouts.API, message="Ready=False DeploymentNotFound",
    )  # fmt: skip
    posted = events(cluster, namespace)
    warnings = {r for t, r in posted if t == "Warning"}
    assert {reasons.TRAINER_NOT_FOUND, reasons.DEPLOYMENT_NOT_FOUND} <= warnings
    assert ("Normal", reasons.WORKLOAD_PENDING) in posted

    # The validating webhook refuses a second WeightSync for the same workloads.
    second = weightsync("second")
    refused = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(second), check=False
    )
    assert refused.returncode != 0
    assert "is already synced by WeightSync sync" in refused.stderr
    # Namespaces the operator does not serve are not its business, though kopf registers
    # the webhooks cluster-wide: the same conflicting pair is admitted there.
    other = f"{namespace}-elsewhere"
    cluster.kubectl("create", "namespace", other)
    try:
        apply(cluster, other, weightsync(), weightsync("second"))
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false")
    assert operator.popen is not None
    assert operator.popen.poll() is None  # still running: no crash loop
    assert "Traceback" not in operator.output()


RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.mark.timeout(180)
def test_injected_pods_meet_restricted_and_device_plugin_gpus_are_refused(
    operator: OperatorProcess, namespace: str
) -> None:
    """Pod Security "restricted" enforced on the namespace admits an injected engine pod
    (the sidecar's own context meets it); an engine asking the device plugin for a GPU is
    refused, with the reason, because its sidecar could not be given that GPU."""
    cluster = operator.cluster
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    restricted = engines("engine", replicas=1, local=False)
    (container,) = restricted["spec"]["template"]["spec"]["containers"]
    container["securityContext"] = RESTRICTED
    device_plugin = engines("gpu-engine", replicas=1, local=False)
    (gpu_container,) = device_plugin["spec"]["template"]["spec"]["containers"]
    gpu_container["securityContext"] = RESTRICTED
    gpu_container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    sync = weightsync()
    sync["spec"]["inference"].append(
        {"deploymentRef": {"name": "gpu-engine"}, "engine": "Reference", "port": 8000}
    )
    apply(cluster, namespace, sync, restricted, device_plugin)
    (injected,) = eventually(
        lambda: pods(cluster, namespace, "engine"), timeout=Timeouts.POD_READY, message="engine"
    )
    assert has_sidecar(injected)

    def refused() -> str | None:
        listed = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "reason=FailedCreate",
            "-o", "jsonpath={.items[*].message}",
        ).stdout  # fmt: skip
        return listed if "device plugin" in listed else None

    message = eventually(refused, timeout=Timeouts.API, message="FailedCreate: device plugin")
    assert "container 'engine' gets its GPUs from a device plugin (nvidia.com/gpu: 1)" in message
    assert "ResourceClaim" in message
    assert pods(cluster, namespace, "gpu-engine") == []
    assert "Traceback" not in operator.output()
