"""The pod runner: a tiny kubelet for pods on KWOK nodes annotated `weightsync.io/run-local`.

For each such pod that KWOK has given an IP, it starts every container's command as
a local process (in its own mount namespace, with the pod's volumes bound at their
mount paths and the pod's env), probes readiness the way a kubelet would, and writes
`ContainersReady` and `Ready` (which also needs every readiness gate True). When a
process exits, the runner stops the pod's other processes and labels the pod for
KWOK's `pod-container-running-failed` stage, so the pod goes Failed and its
controller reacts exactly as to a crashed container. Deleting a pod stops its
processes.

    python -m tests.cluster.podrunner --state-dir DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

from tests.cluster import kwok_stages, podspec
from tests.cluster.controlplane import REPO_ROOT

log = logging.getLogger("podrunner")

PROBE_INTERVAL_SECONDS = 0.5  # faster than a kubelet's default 10 s: tests wait on it
STOP_GRACE_SECONDS = 5.0


class ApiReader:
    """podspec.ClusterReader over the API server."""

    def __init__(self, core: client.CoreV1Api, ca_file: Path) -> None:
        self.core = core
        self.ca_file = ca_file

    def config_map(self, namespace: str, name: str) -> dict[str, str]:
        return dict(self.core.read_namespaced_config_map(name, namespace).data or {})

    def secret(self, namespace: str, name: str) -> dict[str, str]:
        raw = self.core.api_client.sanitize_for_serialization(
            self.core.read_namespaced_secret(name, namespace)
        )
        return podspec.decode_secret(raw.get("data"))

    def service_account_token(
        self, namespace: str, service_account: str, pod: dict[str, Any]
    ) -> str:
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[],
                expiration_seconds=3600,
                bound_object_ref=client.V1BoundObjectReference(
                    kind="Pod",
                    api_version="v1",
                    name=pod["metadata"]["name"],
                    uid=pod["metadata"]["uid"],
                ),
            )
        )
        reply = self.core.create_namespaced_service_account_token(
            service_account, namespace, request
        )
        return str(reply.status.token)

    def ca_certificate(self) -> str:
        return self.ca_file.read_text()


@dataclass
class Container:
    name: str
    process: subprocess.Popen[bytes]
    probe: dict[str, Any] | None
    sidecar: bool = False  # a restartable init container: its status is an init status
    ready: bool = False


@dataclass
class LocalPod:
    uid: str
    namespace: str
    name: str
    ip: str
    containers: list[Container] = field(default_factory=list)
    failed: bool = False
    last_status: str = ""


class PodRunner:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.pods_dir = state_dir / "pods"
        self.pid_dir = state_dir / "pids"
        config.load_kube_config(str(state_dir / "kubeconfig"))
        self.core = client.CoreV1Api()
        self.reader = ApiReader(self.core, state_dir / "pki" / "ca.crt")
        ports = json.loads((state_dir / "ports.json").read_text())
        # The venv's console scripts (weightsync-agent, ...) stand in for an image's binaries.
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
        self.base_env = {
            "PATH": path,
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONUNBUFFERED": "1",
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(ports["apiserver"]),
        }
        for passthrough in ("LANG", "PYTHONPATH", "VIRTUAL_ENV", "WEIGHTSYNC_CACHE"):
            if passthrough in os.environ:
                self.base_env[passthrough] = os.environ[passthrough]
        self.pods: dict[str, LocalPod] = {}
        self.latest: dict[str, dict[str, Any]] = {}  # uid -> pod as last seen
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    # -- watching ------------------------------------------------------------------

    def watch_forever(self) -> None:
        while not self.stopping.is_set():
            try:
                listing = self.core.list_pod_for_all_namespaces()
                seen = set()
                for pod in listing.items:
                    raw = self.core.api_client.sanitize_for_serialization(pod)
                    seen.add(raw["metadata"]["uid"])
                    self._observe("MODIFIED", raw)
                with self.lock:
                    for uid in set(self.latest) - seen:
                        self._observe("DELETED", self.latest[uid])
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=60,
                    _preload_content=False,
                )
                for event in stream:
                    raw = event["raw_object"]
                    if event["type"] == "ERROR":
                        break
                    self._observe(event["type"], raw)
                    if self.stopping.is_set():
                        break
            except Exception:
                log.exception("watch failed; relisting")
                time.sleep(1)

    def _observe(self, kind: str, pod: dict[str, Any]) -> None:
        annotations = pod["metadata"].get("annotations") or {}
        if annotations.get(kwok_stages.RUN_LOCAL) != "true":
            return
        uid = pod["metadata"]["uid"]
        with self.lock:
            if kind == "DELETED":
                self.latest.pop(uid, None)
            else:
                self.latest[uid] = pod

    # -- supervising ---------------------------------------------------------------

    def supervise_forever(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                snapshot = dict(self.latest)
            # Stop deleted pods first: KWOK may already have given their IP to a new pod.
            for uid in set(self.pods) - set(snapshot):
                self._stop(self.pods.pop(uid))
            for uid, pod in snapshot.items():
                try:
                    self._supervise(uid, pod)
                except Exception:
                    log.exception(
                        "pod %s/%s", pod["metadata"]["namespace"], pod["metadata"]["name"]
                    )
            time.sleep(PROBE_INTERVAL_SECONDS / 2)

    def _supervise(self, uid: str, pod: dict[str, Any]) -> None:
        status = pod.get("status") or {}
        labels = pod["metadata"].get("labels") or {}
        local = self.pods.get(uid)
        finished = status.get("phase") in ("Failed", "Succeeded")
        if (
            pod["metadata"].get("deletionTimestamp")
            or finished
            or labels.get(kwok_stages.CRASH_LOOP_LABEL) == "true"
        ):
            if local:
                self._stop(local)
            return
        local = local or self._start_when_possible(uid, pod)
        if local is None or local.failed:
            return
        runs_to_completion = pod["spec"].get("restartPolicy", "Always") != "Always"
        for container in local.containers:
            code = container.process.poll()
            if code == 0 and runs_to_completion and not container.sidecar:
                container.ready = False
                continue  # done, as a Job's or a test pod's container may be
            if code is not None:
                self._fail(local, container.name, code)
                return
            container.ready = self._probe(local.ip, container.probe)
        main = [c for c in local.containers if not c.sidecar]
        if runs_to_completion and all(c.process.poll() == 0 for c in main):
            self._succeed(local, pod)
            return
        self._write_readiness(local, pod)

    def _start_when_possible(self, uid: str, pod: dict[str, Any]) -> LocalPod | None:
        status = pod.get("status") or {}
        if status.get("phase") != "Running" or not status.get("podIP"):
            return None
        if self._ip_in_use(status["podIP"]):
            return None  # a finished pod's processes still hold it; they are being stopped
        started = self._start(uid, pod)  # None while a Secret or ConfigMap is missing
        if started is not None:
            self.pods[uid] = started
        return started

    def _ip_in_use(self, ip: str) -> bool:
        return any(
            other.ip == ip and any(c.process.poll() is None for c in other.containers)
            for other in self.pods.values()
        )

    def _start(self, uid: str, pod: dict[str, Any]) -> LocalPod | None:
        meta = pod["metadata"]
        local = LocalPod(uid, meta["namespace"], meta["name"], pod["status"]["podIP"])
        pod_dir = self.pods_dir / f"{meta['namespace']}_{meta['name']}_{uid[:8]}"
        node_dir = self.state_dir / "nodes" / pod["spec"]["nodeName"]
        base = {**self.base_env, "HOSTNAME": meta["name"]}
        try:
            volumes = podspec.materialise_volumes(pod, pod_dir, node_dir, self.reader)
            sidecars = [
                c
                for c in pod["spec"].get("initContainers", [])
                if c.get("restartPolicy") == "Always"
            ]
            launches = [
                podspec.launch_spec(c, pod, volumes, self.reader, base)
                for c in [*sidecars, *pod["spec"]["containers"]]
            ]
        except client.ApiException as error:
            if error.status != 404:
                raise
            log.info("%s/%s waits for a volume's source: %s", *(meta["namespace"], meta["name"]),
                     error.reason)  # fmt: skip
            return None
        except podspec.PodSpecError as error:
            log.error(  # noqa: TRY400 - the message is the whole story
                "cannot run %s/%s: %s", local.namespace, local.name, error
            )
            local.failed = True
            self._mark_failed(
                local, pod["spec"]["containers"][0]["name"], 128, "CannotRun", str(error)
            )
            return local
        probes = {
            c["name"]: c.get("readinessProbe") for c in [*sidecars, *pod["spec"]["containers"]]
        }
        for launch in launches:
            process = _spawn(launch, pod_dir / f"{launch.name}.log")
            (self.pid_dir / f"pod-{uid[:8]}-{launch.name}.pid").write_text(str(process.pid))
            sidecar = launch.name in {c["name"] for c in sidecars}
            local.containers.append(
                Container(launch.name, process, probes.get(launch.name), sidecar)
            )
            log.info(
                "started %s/%s[%s] pid %d on %s",
                local.namespace,
                local.name,
                launch.name,
                process.pid,
                local.ip,
            )
        return local

    def _probe(self, ip: str, probe: dict[str, Any] | None) -> bool:
        if not probe:
            return True
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                url = f"http://{ip}:{get['port']}{get.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=1) as reply:
                    return 200 <= reply.status < 400
            if "tcpSocket" in probe:
                with socket.create_connection((ip, int(probe["tcpSocket"]["port"])), timeout=1):
                    return True
        except OSError:
            return False
        raise podspec.PodSpecError(f"unsupported readiness probe {sorted(probe)}")

    def _write_readiness(self, local: LocalPod, pod: dict[str, Any]) -> None:
        conditions = {c["type"]: c for c in (pod.get("status") or {}).get("conditions", [])}
        containers_ready = all(c.ready for c in local.containers)
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates", [])]
        gates_true = all(conditions.get(g, {}).get("status") == "True" for g in gates)
        ready = containers_ready and gates_true
        summary = f"{containers_ready}/{ready}/" + ",".join(str(c.ready) for c in local.containers)
        current = (
            conditions.get("ContainersReady", {}).get("status"),
            conditions.get("Ready", {}).get("status"),
        )
        if summary == local.last_status and current == (str(containers_ready), str(ready)):
            return
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = pod.get("status") or {}
        previous = {
            c["name"]: c
            for c in [
                *status.get("containerStatuses", []),
                *status.get("initContainerStatuses", []),
            ]
        }
        images = {c["name"]: c.get("image", "") for c in pod["spec"]["containers"]}
        images |= {c["name"]: c.get("image", "") for c in pod["spec"].get("initContainers", [])}

        def container_status(c: Container) -> dict[str, Any]:
            return {
                "name": c.name,
                "image": images.get(c.name, ""),
                "imageID": "",
                "ready": c.ready,
                "started": True,
                "restartCount": 0,
                "state": previous.get(c.name, {}).get("state") or {"running": {"startedAt": now}},
            }

        def condition(kind: str, value: bool) -> dict[str, str]:
            old = conditions.get(kind, {})
            moved = old.get("status") != str(value)
            return {
                "type": kind,
                "status": str(value),
                "lastTransitionTime": now if moved else old.get("lastTransitionTime", now),
            }

        body = {
            "status": {
                "conditions": [
                    condition("ContainersReady", containers_ready),
                    condition("Ready", ready),
                ],
                "containerStatuses": [
                    container_status(c) for c in local.containers if not c.sidecar
                ],
                "initContainerStatuses": [
                    container_status(c) for c in local.containers if c.sidecar
                ],
            }
        }
        self.core.patch_namespaced_pod_status(local.name, local.namespace, body)
        local.last_status = summary

    def _succeed(self, local: LocalPod, pod: dict[str, Any]) -> None:
        """Every container exited 0 under restartPolicy Never/OnFailure: the pod Succeeded."""
        log.info("%s/%s: every container exited 0: Succeeded", local.namespace, local.name)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        done = {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now}}
        statuses = [
            {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
             "restartCount": 0, "state": done}
            for c in pod["spec"]["containers"]
        ]  # fmt: skip
        local.failed = True  # finished: nothing more to supervise
        self._stop(local)  # sidecars, if any
        body = {
            "status": {
                "phase": "Succeeded",
                "conditions": [
                    {"type": "ContainersReady", "status": "False", "lastTransitionTime": now},
                    {"type": "Ready", "status": "False", "lastTransitionTime": now},
                ],
                "containerStatuses": statuses,
            }
        }
        self.core.patch_namespaced_pod_status(local.name, local.namespace, body)

    def _fail(self, local: LocalPod, container: str, code: int) -> None:
        log.info(
            "%s/%s[%s] exited with %d: failing the pod",
            local.namespace,
            local.name,
            container,
            code,
        )
        local.failed = True
        self._stop(local)
        self._mark_failed(
            local, container, code, "Error", f"container {container} exited with code {code}"
        )

    def _mark_failed(
        self, local: LocalPod, container: str, code: int, reason: str, message: str
    ) -> None:
        prefix = kwok_stages.FAIL_LABEL
        body = {
            "metadata": {
                "labels": {prefix: "true"},
                "annotations": {
                    f"{prefix}/container-name": container,
                    f"{prefix}/exit-code": str(code),
                    f"{prefix}/reason": reason,
                    # KWOK pastes these into a YAML template unquoted: keep them plain.
                    f"{prefix}/message": re.sub(r"[^A-Za-z0-9 ._/-]", " ", message),
                },
            }
        }
        try:
            self.core.patch_namespaced_pod(local.name, local.namespace, body)
        except client.ApiException as error:
            if error.status != 404:
                raise

    def _stop(self, local: LocalPod) -> None:
        for container in local.containers:
            _signal_group(container.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for container in local.containers:
            try:
                container.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(container.process, signal.SIGKILL)
                container.process.wait()
            (self.pid_dir / f"pod-{local.uid[:8]}-{container.name}.pid").unlink(missing_ok=True)
        local.containers = [c for c in local.containers if c.process.returncode is None]

    def stop_all(self) -> None:
        self.stopping.set()
        for local in list(self.pods.values()):
            self._stop(local)


# Where a container's volume sources are bound first, inside its own mount namespace: a
# volume mounted at, say, /tmp must not hide the sources of the mounts after it.
_STAGE = "/.weightsync-podrunner"


def host_paths() -> list[Path]:
    """What a local container needs from the host: the repository and the Python running it.

    An image would carry these; here a volume mounted over, say, /tmp would hide them
    when the checkout or the virtualenv lives below it, so they are bound back on top.
    """
    found = {REPO_ROOT, Path(sys.prefix), Path(sys.base_prefix)}
    return sorted(found, key=lambda path: path.parts)


def mount_script(launch: podspec.ContainerLaunch, keep: Sequence[Path] = ()) -> str:
    """The shell that builds a container's mounts (parents before children) and execs it.

    Host paths in `keep` that a mount would hide are bound back at the same place.
    """
    lines = ["set -e"]
    if launch.mounts:
        Path(_STAGE).mkdir(exist_ok=True)  # an empty mountpoint on the host, made once
        lines.append(f"mount -t tmpfs podrunner {_STAGE}")
        mounts = sorted(launch.mounts, key=lambda mount: Path(mount[1]).parts)
        targets = [Path(target) for _, target in mounts]
        hidden = [p for p in keep if any(p.is_relative_to(t) and p != t for t in targets)]
        sources = [str(source) for source, _ in mounts] + [str(p) for p in hidden]
        for index, source in enumerate(sources):
            lines.append(f"mkdir {_STAGE}/{index}")
            lines.append(f"mount --bind {shlex.quote(source)} {_STAGE}/{index}")
        for index, target in enumerate([*map(str, targets), *map(str, hidden)]):
            lines.append(f"mkdir -p {shlex.quote(target)}")
            lines.append(f"mount --bind {_STAGE}/{index} {shlex.quote(target)}")
    if launch.working_dir:
        lines.append(f"cd {shlex.quote(launch.working_dir)}")
    lines.append("exec " + " ".join(shlex.quote(part) for part in launch.argv))
    return "\n".join(lines)


def _spawn(launch: podspec.ContainerLaunch, log_path: Path) -> subprocess.Popen[bytes]:
    """Start one container: a private mount namespace with its volumes bound, then exec."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    script = mount_script(launch, host_paths())
    with log_path.open("ab") as output:
        return subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env=launch.env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    runner = PodRunner(args.state_dir)

    def terminate(signum: int, frame: object) -> None:
        runner.stop_all()
        sys.exit(0)

    signal.signal(signal.SIGTERM, terminate)
    threading.Thread(target=runner.watch_forever, daemon=True, name="watch").start()
    runner.supervise_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
