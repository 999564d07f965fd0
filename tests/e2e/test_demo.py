"""The README's first command, headless: the whole stack syncs on the real node, a failed
engine pod is replaced and recovers, out of its Service's endpoints until it serves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cluster.controlplane import NodeImages
from tests.e2e import demo, upgrade
from tests.support.eventually import Timeouts, eventually
from weightsync.api.protocol import PROTOCOL_VERSION

# own_node: it runs first, its node importing the images the session cluster's node then
# finds (one import of each, not two).
pytestmark = [pytest.mark.e2e, pytest.mark.own_node, pytest.mark.timeout(1200)]


def test_demo_scenario(tmp_path: Path, node_images: NodeImages) -> None:
    state_dir = tmp_path / "demo"
    with node_images.turn("the demo") as images_dir:
        stack = demo.Demo(
            state_dir, demo.Console(quiet=True), keep_images=False, images_dir=images_dir
        )
        try:
            result = demo.run(stack, rounds=6, kill_at=2)
            # Then the operator upgraded to the next release (protocol N+1) under training.
            upgraded = upgrade.run(stack)
            after_upgrade = stack.wait_ready_condition()
            print(upgraded.summary())  # what docs/install.md records
            # The operator reads no Secret of a workload namespace (its tokens are derived),
            # nor holds a verb that answers with one (patch, delete).
            reads = {
                (verb, namespace): stack.operator_may(verb, "secrets", namespace)
                for verb in ("get", "list", "watch", "patch", "delete")
                for namespace in (demo.NAMESPACE, "kube-system")
            }
            token_key = stack.operator_may(
                "get", "secrets/weightsync-token-key", demo.SYSTEM_NAMESPACE
            )
            # The chart's own test passes on the live release (its pod stays until uninstall).
            helm_test = stack.helm_test()
            test_pods = stack.test_pods()
            # Uninstalled, the cluster works without the operator: no webhook left refusing
            # WeightSyncs, no finalizer left hanging a delete.
            after_uninstall_seconds = stack.uninstall_chart()
            # The uninstall hook deleted the test pod (a pod that ended goes at once).
            eventually(
                lambda: stack.test_pods() == [], timeout=Timeouts.API, message="test pod left"
            )
            webhooks = stack.cluster.kubectl(
                "get", "mutatingwebhookconfigurations,validatingwebhookconfigurations", "-o", "name"
            ).stdout.split()
            logs = {
                str(path.relative_to(state_dir)): path.read_text(errors="replace")
                for pattern in ("logs/*.log", "node/pod-logs/*/*/*.log")
                for path in state_dir.glob(pattern)
            }
        finally:
            stack.close()

    assert helm_test.returncode == 0, helm_test.stdout + helm_test.stderr
    assert re.search(r"Phase:\s+Succeeded", helm_test.stdout), helm_test.stdout
    assert test_pods == ["pod/weightsync-test-webhooks"]
    assert not any(reads.values()), reads
    assert token_key
    assert after_uninstall_seconds < 30
    assert [w for w in webhooks if "weightsync" in w] == []
    versions = [r.version for r in result.rounds]
    assert versions == list(range(1, len(versions) + 1))
    assert len(versions) >= 6
    assert result.rounds[0].ok, result.rounds[0]
    assert result.rounds[-1].ok, result.rounds[-1]
    failed = [r for r in result.rounds if not r.ok]
    assert all(r.reason for r in failed), failed  # a failed round always says why
    assert result.killed_pod
    assert result.replacement_pod not in ("", result.killed_pod)
    assert result.ready_at_stale_version == []
    assert result.endpoints_while_recovering == []
    assert set(result.images) == {"operator", "agent", "reference-engine"}
    assert len(result.versions) == 2
    assert set(result.versions.values()) == {versions[-1]}
    assert all(result.identical.values()), result.identical
    # The upgrade: both operator pods on the next release, no trainer or engine pod
    # restarted or replaced, rounds on throughout (at most the one in flight at the
    # Lease's hand-over failed), and a replaced engine recovered by the new operator.
    assert upgraded.operator_images == [f"weightsync/operator:{upgrade.NEXT_TAG}"] * 2
    assert upgraded.operator_protocol == PROTOCOL_VERSION + 1
    assert upgraded.pods_after == upgraded.pods_before
    assert len(upgraded.pods_before) == 4  # two trainer ranks, two engines
    assert len(upgraded.rounds) >= 3, upgraded.rounds
    assert len([r for r in upgraded.rounds if not r.ok]) <= 1, upgraded.rounds
    assert upgraded.replacement not in ("", upgraded.replaced)
    assert len(upgraded.identical) == 2, upgraded
    assert all(upgraded.identical.values()), upgraded
    assert after_upgrade[0] == "True", after_upgrade
    # The dashboard's round quantiles, drawn from rank 0's histogram, within 10% of those
    # of the same rounds (1 ms for the rounds' rounding to whole milliseconds).
    own = result.own_quantiles_ms()
    steps = [name for name, _ in stack.console.steps]  # timed for the summary
    assert any(name.startswith("helm install") for name in steps), steps
    for q in ("p50", "p99"):
        drawn = result.latency_quantiles_ms[q]
        assert own[q] > 0
        assert abs(drawn - own[q]) <= 0.1 * own[q] + 1, (q, drawn, own)
    # Every panel's queries ran against the live Prometheus (an error raises); only the
    # failure panels may be empty, since a clean run has no failures to count.
    assert set(result.panels_without_data) <= {
        "Round failures by reason",
        "Recovery failures by reason",
    }, result.panels_without_data
    assert "Recovery duration" in result.panels_with_data
    assert result.ready[0] == "True", result.ready  # the failed pod is not waited for
    assert set(result.alerts_evaluated) == {
        "WeightSyncSyncStalled",
        "WeightSyncVersionLag",
        "WeightSyncRoundsStopped",
        "WeightSyncRecoveryFailing",
        "WeightSyncPrewarmSlow",
        "WeightSyncOperatorDown",
        "WeightSyncWebhookErrors",
        "WeightSyncDegraded",
    }
    # The live operator is scraped under the job the chart's alert names.
    assert result.alerts_evaluated["WeightSyncOperatorDown"] == 0
    assert result.dashboard_png is not None
    assert result.dashboard_png.stat().st_size > 10_000
    with_traceback = [name for name, text in logs.items() if "Traceback" in text]
    assert with_traceback == [], {name: logs[name][-2000:] for name in with_traceback}
