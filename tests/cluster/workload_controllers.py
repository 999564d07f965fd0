"""The LeaderWorkerSet and JobSet controllers in a local cluster, as their projects ship them.

Multi-host engines run as LeaderWorkerSets and training jobs as JobSets; the operator
follows their pods' owner chains and labels (docs/operator.md). Those labels, the leader
and worker StatefulSets, the Jobs and their indexes are set by the projects' own
controllers and pod webhooks, so the e2e runs the real ones: each manager is built once
from its published Go module (the release's source, pinned by its module hash) into the
binary cache, runs on the host against the cluster's API server, and serves its webhooks
on loopback with a certificate of the cluster's local CA. CRDs and webhook configurations
come from the module's `config/` (the pod webhooks with the object selectors the
projects' kustomize patches add, so they see only their own pods).

Built on first use, not by `.ci/setup`: the demo does not need them (about 3 minutes
each on 2 cores the first time).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.controlplane import CACHE_DIR, LocalCluster
from tests.cluster.pki import CertificateAuthority
from tests.support.ports import free_port


@dataclass(frozen=True)
class Project:
    name: str
    module: str
    version: str
    sum: str  # the module's h1: hash (go.sum's), checked before building
    package: str  # the manager's main package, relative to the module
    config_api: str  # its Configuration's apiVersion
    crds: str  # the CRD directory in the module
    webhooks: str  # the webhook manifests in the module
    pod_label: str  # the label the pod webhooks' object selector requires


LWS = Project(
    name="lws",
    module="sigs.k8s.io/lws",
    version="v0.7.0",
    sum="h1:qWfzX8+UBak+Hq0+m/PuE3uO0mp/3dmm5q/h/7z31A8=",
    package="./cmd",
    config_api="config.lws.x-k8s.io/v1alpha1",
    crds="config/crd/bases",
    webhooks="config/webhook/manifests.yaml",
    pod_label="leaderworkerset.sigs.k8s.io/name",
)
JOBSET = Project(
    name="jobset",
    module="sigs.k8s.io/jobset",
    version="v0.10.1",
    sum="h1:u8QKifNsrWVrlRFe6w2ofYTqFT9ma2DRHxfeB2m9xyU=",
    package=".",
    config_api="config.jobset.x-k8s.io/v1alpha1",
    crds="config/components/crd/bases",
    webhooks="config/components/webhook/manifests.yaml",
    pod_label="jobset.sigs.k8s.io/jobset-name",
)
PROJECTS = (LWS, JOBSET)
READY_SECONDS = 60.0


def _go_env() -> dict[str, str]:
    # The checksum database is not reachable everywhere: the module's own hash is checked
    # against `Project.sum`, its dependencies against the module's go.sum (-mod=readonly).
    return {
        **os.environ,
        "GOFLAGS": "-mod=readonly -buildvcs=false",
        "GOSUMDB": "off",
        "CGO_ENABLED": "0",
    }


def build(project: Project) -> Path:
    """The directory holding the project's `manager`, CRDs and webhook manifests."""
    go_version = subprocess.run(
        ["go", "env", "GOVERSION"], capture_output=True, text=True, check=True
    ).stdout.strip()
    out = CACHE_DIR / "bin" / f"{project.name}-{project.version}_{go_version}"
    if (out / "manager").exists():
        return out
    env = _go_env()
    fetched = subprocess.run(
        ["go", "mod", "download", "-json", f"{project.module}@{project.version}"],
        capture_output=True, text=True, check=True, env=env, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    info = json.loads(fetched.stdout)
    if info.get("Sum") != project.sum:
        raise RuntimeError(f"{project.module}@{project.version}: hash {info.get('Sum')}")
    staging = Path(tempfile.mkdtemp(prefix=f"{project.name}-build-"))
    try:
        source = staging / "src"
        shutil.copytree(info["Dir"], source)  # the module cache is read-only
        subprocess.run(["chmod", "-R", "u+w", str(source)], check=True)
        built = staging / "out"
        built.mkdir()
        subprocess.run(
            ["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(built / "manager"),
             project.package],
            check=True, env=env, cwd=source,
        )  # fmt: skip
        shutil.copytree(source / project.crds, built / "crds")
        shutil.copy(source / project.webhooks, built / "webhooks.yaml")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        built.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def webhook_configurations(
    project: Project, manifests: str, url: str, ca_bundle: bytes
) -> list[dict[str, Any]]:
    """The project's webhook configurations, named for this cluster, pointing at `url`;
    pod webhooks see only the project's pods (the selector its kustomize patch adds)."""
    configurations = []
    for document in yaml.safe_load_all(manifests):
        if not document:
            continue
        document["metadata"] = {"name": f"{project.name}-{document['metadata']['name']}"}
        for hook in document["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"{url}{path}",
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = {
                    "matchExpressions": [{"key": project.pod_label, "operator": "Exists"}]
                }
        configurations.append(document)
    return configurations


class WorkloadControllers:
    """Both managers running against `cluster`; `stop` ends them and their webhooks."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.directory = cluster.state_dir / "workload-controllers"
        self._processes: list[subprocess.Popen[bytes]] = []
        self._configurations: list[tuple[str, str]] = []

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        ca = CertificateAuthority(self.cluster.pki_dir)
        cert, key = ca.issue("workload-webhooks", "127.0.0.1", ip_addresses=("127.0.0.1",),
                             server=True)  # fmt: skip
        try:
            for project in PROJECTS:
                self._start(project, build(project), cert, key, ca.cert_path.read_bytes())
        except BaseException:
            self.stop()
            raise

    def _start(self, project: Project, built: Path, cert: Path, key: Path, ca: bytes) -> None:
        own = self.directory / project.name
        certs = own / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        shutil.copy(cert, certs / "tls.crt")
        shutil.copy(key, certs / "tls.key")
        webhook_port, health_port = free_port(), free_port()
        config = {
            "apiVersion": project.config_api,
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        }
        (own / "config.yaml").write_text(yaml.safe_dump(config))
        self.cluster.kubectl("apply", "--server-side", "-f", str(built / "crds"))
        for crd in sorted((built / "crds").glob("*.yaml")):
            name = yaml.safe_load(crd.read_text())["metadata"]["name"]
            self.cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}")
        log = (self.cluster.log_dir / f"{project.name}-manager.log").open("ab")
        with log:
            self._processes.append(
                subprocess.Popen(
                    [str(built / "manager"), f"--config={own / 'config.yaml'}"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)},
                )
            )
        _wait_ready(project, f"http://127.0.0.1:{health_port}/readyz", self._processes[-1])
        url = f"https://127.0.0.1:{webhook_port}"
        for document in webhook_configurations(
            project, (built / "webhooks.yaml").read_text(), url, ca
        ):
            self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(document))
            self._configurations.append((document["kind"].lower(), document["metadata"]["name"]))

    def stop(self) -> None:
        # Webhooks first: a pod webhook whose server is gone fails its pods' creation.
        for kind, name in self._configurations:
            self.cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
        self._configurations.clear()
        for process in self._processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        self._processes.clear()


def _wait_ready(project: Project, url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the {project.name} manager exited ({process.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 - loopback
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the {project.name} manager not ready at {url} in {READY_SECONDS} s")
