"""The operator end to end on the local control plane, with real agents, engines and a trainer.

The operator runs as its own process (`weightsync-operator`, URL-mode webhook on
127.0.0.1, certificates it generates itself); the API server calls its webhooks over
TLS; trainer and inference pods run as containers on the cluster's real node (the
reference trainer, reference engines, and the injected `weightsync-agent` sidecars), so
every round is a real gloo broadcast driven by a real Publisher.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.support.eventually import Timeouts, eventually
from tests.support.operator import (
    PODS_UP,
    OperatorProcess,
    apply,
    engines,
    events,
    gates,
    has_sidecar,
    pods,
    reason,
    step,
    sync_status,
    trainer,
    weightsync,
)
from weightsync.api import reasons
from weightsync.controller import names

pytestmark = pytest.mark.cluster


# -- the tests -------------------------------------------------------------------------


@pytest.mark.timeout(900)
def test_injection_prewarm_rounds_scaling_restart_and_deletion(
    operator: OperatorProcess, namespace: str
) -> None:
    cluster = operator.cluster
    apply(cluster, namespace, weightsync())
    apply(cluster, namespace, trainer(), engines(replicas=2))

    # The API server called the webhook: every selected pod carries the sidecar, and the
    # inference pods the readiness gate, which holds them NotReady before any version.
    def group_of(count: int) -> dict[str, Any] | None:
        status = sync_status(cluster, namespace)
        members = status.get("members") or []
        warm = reason(status, "Prewarmed") == ("True", reasons.GROUP_WARM)
        return status if len(members) == count and warm else None

    status = eventually(lambda: group_of(3), timeout=PODS_UP, interval=1, message="3 warm ranks")
    trainer_pod = pods(cluster, namespace, "trainer")[0]
    engine_pods = pods(cluster, namespace, "engine")
    assert all(has_sidecar(p) for p in [trainer_pod, *engine_pods])
    for pod in engine_pods:
        assert pod["spec"]["readinessGates"] == [{"conditionType": names.WEIGHTS_CURRENT}]
        assert pod["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "sync"
    assert [(m["rank"], m["role"]) for m in status["members"]] == [
        (0, "Source"), (1, "Sink"), (2, "Sink"),
    ]  # fmt: skip
    assert status["members"][0]["pod"] == "trainer-0"
    assert reason(status, "Ready") == ("True", reasons.AWAITING_FIRST_VERSION)
    assert "currentVersion" not in status  # warm before the trainer's first publish
    # Held closed before any version; the gate condition itself is written by the pass
    # after the one that reported the group warm (until then a missing gate counts False).
    held = gates(cluster, namespace)
    assert all(g[0] != "True" and g[1] != "True" for g in held.values()), held
    eventually(
        lambda: all(g == ("False", "False") for g in gates(cluster, namespace).values()),
        timeout=Timeouts.API, message="gates written closed before the first version",
    )  # fmt: skip

    # A round: every inference pod serves version 1, its gate opens, and kubectl shows it.
    trainer_ip = trainer_pod["status"]["podIP"]
    first = step(trainer_ip)
    assert first["ok"], first
    assert first["generation"] == status["groupGeneration"]
    eventually(
        lambda: all(g == ("True", "True") for g in gates(cluster, namespace).values()),
        timeout=Timeouts.API, message="gates open after the first round",
    )  # fmt: skip
    table = cluster.kubectl("get", "wsync", "-n", namespace, "sync").stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "READY", "VERSION", "MEMBERS"]
    assert table[1].split()[:4] == ["sync", "True", "1", "3"]

    # Scale 2 -> 4 while training: the newcomers are warmed in a new generation in the
    # background and join at a round boundary; no round fails meanwhile.
    before = status["groupGeneration"]
    cluster.kubectl("scale", "deployment", "engine", "-n", namespace, "--replicas=4")
    results = [first]
    deadline = time.monotonic() + PODS_UP
    while time.monotonic() < deadline:
        results.append(step(trainer_ip))
        status = sync_status(cluster, namespace)
        latest = results[-1]["version"]
        if (
            len(status.get("members") or []) == 5
            and status.get("currentVersion") == latest
            and results[-1]["generation"] == status["groupGeneration"]
            and all(m.get("version") == latest for m in status["members"])
        ):
            break
        time.sleep(1)
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    assert status["groupGeneration"] > before
    assert len(status["members"]) == 5
    eventually(
        lambda: len(gates(cluster, namespace)) == 4
        and all(g == ("True", "True") for g in gates(cluster, namespace).values()),
        timeout=Timeouts.API, message="all four engines serve the current version",
    )  # fmt: skip

    # Restarting the operator between rounds changes nothing.
    settled = sync_status(cluster, namespace)
    operator.stop()
    operator.start()
    eventually(
        lambda: operator.passes() >= 3, timeout=Timeouts.API, message="3 passes after restart"
    )
    again = sync_status(cluster, namespace)
    for key in ("groupGeneration", "members", "currentVersion", "lastRound", "conditions"):
        assert again[key] == settled[key], key
    result = step(trainer_ip)
    assert result["ok"], result
    assert result["generation"] == settled["groupGeneration"]

    # A spec change the agents only learn from a plan (transfer options) re-plans the group.
    cluster.kubectl(
        "patch", "weightsync", "sync", "-n", namespace, "--type=merge",
        "-p", '{"spec": {"transfer": {"timeoutSeconds": 45}}}',
    )  # fmt: skip

    def replanned_group() -> dict[str, Any] | None:
        group = group_of(5)
        newer = group is not None and group["groupGeneration"] > settled["groupGeneration"]
        return group if newer else None

    replanned = eventually(
        replanned_group, timeout=Timeouts.API, message="a new warm generation after the change"
    )
    result = step(trainer_ip)
    assert result["ok"], result
    assert result["generation"] == replanned["groupGeneration"]

    # Deleting the WeightSync releases the gates and leaves nothing behind.
    cluster.kubectl("delete", "weightsync", "sync", "-n", namespace, "--timeout=60s")
    secret = names.token_secret_name("sync")
    eventually(
        lambda: cluster.kubectl("get", "secret", secret, "-n", namespace, check=False).returncode
        != 0,
        timeout=Timeouts.GARBAGE_COLLECTION, message="token Secret garbage-collected",
    )  # fmt: skip
    assert all(g[0] == "True" for g in gates(cluster, namespace).values())
    leftovers = cluster.kubectl(
        "get", "secrets,configmaps,services", "-n", namespace, "-l", f"{names.SYNC_LABEL}=sync",
        "-o", "name",
    ).stdout.strip()  # fmt: skip
    assert leftovers == ""
    assert ("Normal", "GenerationPlanned") in events(cluster, namespace)
    assert "Traceback" not in operator.output()
