"""KWOK's configuration: which fake-kubelet transitions pods and nodes go through.

Upstream's node and pod stages are read from the KWOK release the build copied, with
one change: upstream's `pod-ready` also sets every readiness-gate condition True, which
no kubelet does (the gate's controller owns it; a missing condition reads False). With it,
every new pod was Ready before the operator had decided anything, and the operator had
to close a gate it never opened: a thousand extra writes at `make scale`. Pods that must
really run go to the cluster's real node instead (`node/realnode.py`).

Failure injection: upstream's `pod-container-running-failed` (label
`FAIL_LABEL=true`, the pod goes Failed) and our `pod-crash-loop` (label
`CRASH_LOOP_LABEL=true`, containers wait in CrashLoopBackOff, the pod stays Running).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
CRASH_LOOP_LABEL = "weightsync.io/crash-loop"

_UPSTREAM = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat/node-heartbeat.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
    "pod/chaos/pod-container-running-failed.yaml",
)

_POD_CRASH_LOOP = """
{{ $now := Now }}
conditions:
- {type: ContainersReady, status: "False", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  started: false
  restartCount: 5
  lastState:
    terminated: {exitCode: 1, reason: Error, finishedAt: {{ $now | Quote }}}
  state:
    waiting:
      reason: CrashLoopBackOff
      message: back-off restarting failed container
{{ end }}
phase: Running
"""


def _stage(name: str, selector: list[dict[str, Any]], template: str) -> dict[str, Any]:
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": selector},
            "next": {"statusTemplate": template},
        },
    }


# The readiness-gate conditions of upstream's pod-ready template (see the docstring).
_READINESS_GATES = re.compile(
    r"\n[ \t]*\{\{ range \.spec\.readinessGates \}\}.*?\{\{ end \}\}", re.S
)


def _without_readiness_gates(stage: dict[str, Any]) -> dict[str, Any]:
    template = stage["spec"]["next"]["statusTemplate"]
    kept, found = _READINESS_GATES.subn("", template)
    if found != 1:  # an upstream change: look at it rather than run with either behaviour
        raise ValueError(f"{stage['metadata']['name']}: readiness gates not found once in it")
    stage["spec"]["next"]["statusTemplate"] = kept
    return stage


def _not_deleted() -> dict[str, Any]:
    return {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}


def stages(upstream_dir: Path) -> list[dict[str, Any]]:
    """All stages: upstream's, and a crash loop on demand."""
    result = []
    for relative in _UPSTREAM:
        stage = yaml.safe_load((upstream_dir / relative).read_text())
        if stage["metadata"]["name"] == "pod-container-running-failed":
            stage["spec"]["delay"] = {"durationMilliseconds": 0}  # fail at once when asked
        if stage["metadata"]["name"] == "pod-ready":
            stage = _without_readiness_gates(stage)
        result.append(stage)
    result.append(
        _stage(
            "pod-crash-loop",
            [
                _not_deleted(),
                {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                {
                    "key": f'.metadata.labels["{CRASH_LOOP_LABEL}"]',
                    "operator": "In",
                    "values": ["true"],
                },
                # Applied once: without this the stage would match its own result forever.
                {
                    "key": ".status.containerStatuses.[0].state.waiting.reason",
                    "operator": "NotIn",
                    "values": ["CrashLoopBackOff"],
                },
            ],
            _POD_CRASH_LOOP,
        )
    )
    return result


def render(upstream_dir: Path) -> str:
    """The `--config` file for kwok: its options and every stage."""
    return yaml.safe_dump_all(stages(upstream_dir), sort_keys=False)
