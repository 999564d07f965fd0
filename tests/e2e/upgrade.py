"""An operator upgrade under training, as a user runs it: `helm upgrade` to the next
release's operator while the trainer keeps stepping, the agents staying at this release.

The next release is made here the way a release that changes a message is made
(`api/protocol.py`'s rule): this tree with `PROTOCOL_VERSION` one higher and a plan field
added under it, built as the operator image `weightsync/operator:next` and imported into
the node. The chart's two replicas roll over to it (one new pod at a time, a ready one
kept throughout); the engines and trainer ranks are never restarted, their agents stay
one version behind, and every round commits (at most the one in flight at the Lease's
hand-over may fail). The next release's operator then plans and recovers a replaced
engine whose agent is of this release.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster import images
from tests.e2e import demo
from tests.support.eventually import eventually
from weightsync.api.protocol import PROTOCOL_VERSION

NEXT_TAG = "next"
NEXT_FIELD = "release_note"  # the field the next release adds to `MembershipPlan`
ROLLOUT_SECONDS = 300.0


@dataclass
class Upgrade:
    rounds: list[demo.RoundRow] = field(default_factory=list)  # from the upgrade's start
    rounds_after: list[demo.RoundRow] = field(default_factory=list)  # while an engine is replaced
    pods_before: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> uid, restarts
    pods_after: dict[str, tuple[str, int]] = field(default_factory=dict)
    operator_images: list[str] = field(default_factory=list)
    operator_protocol: int = 0
    replaced: str = ""  # the engine pod replaced under the next release's operator
    replacement: str = ""
    identical: dict[str, bool] = field(default_factory=dict)  # engine pod -> the trainer's bytes
    rollout_seconds: float = 0.0  # helm upgrade until both operator pods run the next release
    recovered_seconds: float = 0.0  # the engine pod deleted until its replacement is Ready

    def summary(self) -> str:
        failed = [r for r in self.rounds if not r.ok]
        return (
            f"upgrade: rollout {self.rollout_seconds:.1f} s, {len(self.rounds)} rounds from its"
            f" start ({len(failed)} failed: {[r.reason for r in failed]}), operator protocol"
            f" {self.operator_protocol}; engine replaced under it Ready in"
            f" {self.recovered_seconds:.1f} s"
        )


def _patch(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise AssertionError(f"{path.name}: {old!r} is not where the upgrade test expects it")
    path.write_text(text.replace(old, new))


def next_release(tree: Path) -> None:
    """Copy what the operator image is built from into `tree`, as the next release."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(demo.REPO_ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("images", "operator"):
        shutil.copytree(demo.REPO_ROOT / name, tree / name, ignore=ignore)
    api = tree / "operator" / "weightsync" / "api"
    nxt = PROTOCOL_VERSION + 1
    _patch(api / "protocol.py", f"PROTOCOL_VERSION = {PROTOCOL_VERSION}\n",
           f"PROTOCOL_VERSION = {nxt}\n")  # fmt: skip
    added = f'    "MembershipPlan.{NEXT_FIELD}": {nxt},\n'
    _patch(api / "protocol.py", "ADDED: Mapping[str, int] = {\n",
           "ADDED: Mapping[str, int] = {\n" + added)  # fmt: skip
    _patch(api / "control.py", "    holder: bool = False\n    local_engine:",
           f'    holder: bool = False\n    {NEXT_FIELD}: str = ""\n    local_engine:')  # fmt: skip


def build_next_operator(stack: demo.Demo) -> images.ImageInfo:
    with tempfile.TemporaryDirectory(prefix="weightsync-next-") as scratch:
        next_release(Path(scratch))
        spec = images.SPECS["operator"]
        ref = f"{spec.repository}:{NEXT_TAG}"
        info = images.build(spec, context=Path(scratch), ref=ref)
    images.import_image(info, stack.cluster.node.containerd_address)
    return info


def _workload_pods(stack: demo.Demo) -> dict[str, tuple[str, int]]:
    found = {}
    for label in ("app=trainer", "app=engine-a", "app=engine-b"):
        for pod in stack.pods(label):
            restarts = sum(c.get("restartCount", 0) for c in pod["status"]["containerStatuses"])
            found[pod["metadata"]["name"]] = (pod["metadata"]["uid"], restarts)
    return found


def _operator_pods(stack: demo.Demo) -> list[dict[str, Any]]:
    selector = "app.kubernetes.io/instance=weightsync,app.kubernetes.io/component=operator"
    listed = stack.get("pods", "-n", demo.SYSTEM_NAMESPACE, "-l", selector)
    return [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]


def _rolled_over(stack: demo.Demo) -> bool:
    pods = _operator_pods(stack)
    return len(pods) == 2 and all(
        p["spec"]["containers"][0]["image"].endswith(f":{NEXT_TAG}")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
        for p in pods
    )


def run(stack: demo.Demo) -> Upgrade:
    """Build the next release's operator, `helm upgrade` to it while the trainer steps,
    then replace an engine pod under it."""
    upgrade = Upgrade()
    console = stack.console
    with console.step("Building the next release's operator (protocol N+1)"):
        build_next_operator(stack)
    upgrade.pods_before = _workload_pods(stack)
    stepping = threading.Event()
    stepping.set()

    failed: list[BaseException] = []

    def train() -> None:
        try:
            while stepping.is_set():
                upgrade.rounds.append(stack.step())
        except BaseException as exc:  # a step that errs (not a failed round) ends the test
            failed.append(exc)
            raise

    trainer = threading.Thread(target=train, name="upgrade-trainer", daemon=True)
    trainer.start()
    try:
        helm = str(stack.cluster.bin_dir / "helm")
        started = time.monotonic()
        with console.step("helm upgrade weightsync to the next release's operator, training on"):
            upgraded = subprocess.run(
                [helm, "upgrade", "weightsync", str(demo.CHART), "--reuse-values",
                 "--namespace", demo.SYSTEM_NAMESPACE,
                 "--kubeconfig", str(stack.cluster.kubeconfig), "--set", f"image.tag={NEXT_TAG}",
                 "--wait", "--timeout", f"{int(ROLLOUT_SECONDS)}s"],
                check=False, capture_output=True, text=True, timeout=ROLLOUT_SECONDS + 30,
            )  # fmt: skip
            if upgraded.returncode != 0:
                state = stack.system_state()
                raise demo.DemoError(f"helm upgrade failed: {upgraded.stderr}\n{state}")
            eventually(lambda: _rolled_over(stack), timeout=ROLLOUT_SECONDS, interval=1,
                       message="both operator pods on the next release")  # fmt: skip
        upgrade.rollout_seconds = time.monotonic() - started
        # Rounds on under the new operator: a few after the hand-over.
        seen = len(upgrade.rounds)
        eventually(lambda: len(upgrade.rounds) >= seen + 3, timeout=3 * demo.ROUND_SECONDS,
                   interval=0.5, message="rounds after the upgrade")  # fmt: skip
    finally:
        stepping.clear()
        trainer.join(timeout=demo.ROUND_SECONDS)
    if failed:
        raise demo.DemoError(f"a step failed during the upgrade: {failed[0]!r}") from failed[0]
    upgrade.pods_after = _workload_pods(stack)
    upgrade.operator_images = sorted(
        p["spec"]["containers"][0]["image"] for p in _operator_pods(stack)
    )
    pod = _operator_pods(stack)[0]["metadata"]["name"]
    said = stack.cluster.kubectl(
        "exec", "-n", demo.SYSTEM_NAMESPACE, pod, "--", "python3", "-c",
        "from weightsync.api.protocol import PROTOCOL_VERSION; print(PROTOCOL_VERSION)",
    ).stdout  # fmt: skip
    upgrade.operator_protocol = int(re.findall(r"\d+", said)[-1])
    # The next release's operator plans a new agent of this release in and recovers it.
    result = demo.DemoResult()
    upgrade.replaced, _ = stack.fail_engine_pod("engine-a")
    deleted = time.monotonic()
    with console.step("An engine pod replaced under the next release's operator"):

        def back() -> bool:
            if stack.replacement_ready("engine-a", upgrade.replaced, result):
                return True
            upgrade.rounds_after.append(stack.step())
            return False

        eventually(back, timeout=demo.STACK_WARM_SECONDS, interval=1, message="replacement Ready")
        upgrade.recovered_seconds = time.monotonic() - deleted

        def synced() -> bool:
            upgrade.rounds_after.append(stack.step())
            stack.verify(result)
            return upgrade.rounds_after[-1].ok and all(result.identical.values())

        eventually(synced, timeout=demo.STACK_WARM_SECONDS, interval=1, message="engines synced")
    upgrade.replacement = result.replacement_pod
    upgrade.identical = dict(result.identical)
    if result.ready_at_stale_version:
        raise demo.DemoError(f"Ready at a stale version: {result.ready_at_stale_version}")
    return upgrade
