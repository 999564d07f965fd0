"""A real Kubernetes control plane on this machine, with a real node or fake ones.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as local
processes built by `build/build.sh`. Nodes:

* `real_node=True`: one real node (`node/realnode.py`): kubelet, containerd + runc,
  CNI and kube-proxy in a network namespace of their own; pods are containers from
  images imported into its containerd. The API server listens on the node link's host
  address, which pods reach through the `kubernetes` Service; CoreDNS listens there too
  and is every pod's nameserver (Service and pod names resolve, as in a real cluster).
* `nodes=N`: N fake GPU nodes played by KWOK (label `type=kwok`): pods scheduled there
  are marked Running and Ready and never run. For what needs scheduling only, and for
  scale: a fake node costs nothing.

    python -m tests.cluster.controlplane up [--state-dir DIR] [--nodes N] [--real-node]
    python -m tests.cluster.controlplane down [--state-dir DIR]

`up` writes DIR/kubeconfig and DIR/pids/*.pid; `down` stops only those PIDs and undoes
what the node changed on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.cluster import kwok_stages
from tests.cluster.node.realnode import CLUSTER_DOMAIN, GPU_DRIVER, NODE_NAME, RealNode
from tests.cluster.pki import CertificateAuthority, service_account_keys
from tests.support.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "tests" / "cluster" / "build" / "build.sh"
CACHE_DIR = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync"))
DEFAULT_STATE_DIR = CACHE_DIR / "clusters" / "default"
SERVICE_CIDR = "10.96.0.0/16"
GPU_RESOURCE = "nvidia.com/gpu"

# How long each component may take to answer its health check before `up` fails.
ETCD_READY_SECONDS = 30
APISERVER_READY_SECONDS = 60
NODES_READY_SECONDS = 60
NODE_READY_SECONDS = 120  # the real node: kubelet registration and CNI ready


class KubectlError(RuntimeError):
    """kubectl failed; the message carries its stderr."""


def build_binaries() -> Path:
    """Build (or find cached) control-plane binaries; return their directory."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(result.stdout.strip().splitlines()[-1])


def binaries_dir() -> Path:
    """Where `build_binaries` puts (or has put) the binaries, without building."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-dir"], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(result.stdout.strip())


def _wait_until(check: object, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        try:
            if callable(check) and check():
                return
        except OSError as error:
            last_error = str(error)
        time.sleep(0.2)
    tail = ""
    if log and log.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s ({last_error})\n{tail}")


class NodeImages:
    """One containerd root (images and their unpacked layers) for the real nodes of this
    session, which take turns on it: each image is imported once, not once per node.
    containerd locks its root, so two nodes never hold it together."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.holder = ""

    @contextlib.contextmanager
    def turn(self, holder: str) -> Iterator[Path | None]:
        """The shared root while `holder` runs its node; None (a root of its own) while
        another holds it."""
        if self.holder:
            yield None
            return
        self.holder = holder
        try:
            yield self.path
        finally:
            self.holder = ""


@dataclass
class LocalCluster:
    """One local control plane, its files under `state_dir`."""

    state_dir: Path = DEFAULT_STATE_DIR
    bin_dir: Path = field(default_factory=Path)
    nodes: int = 2
    gpus_per_node: int = 4
    real_node: bool = False
    keep_images: bool = False  # a stable state dir keeps the node's imported images
    # containerd's root, when not under the state dir: clusters up one after the other
    # (never together) may share it and import each image once.
    images_dir: Path | None = None
    _children: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    @property
    def node(self) -> RealNode:
        """The real node (its state, containerd and network), started or not."""
        return RealNode(self.state_dir, self.bin_dir, CACHE_DIR, self.images_dir)

    @property
    def api_host(self) -> str:
        """Where the API server listens: the node link's host address with a real node."""
        return self.node.network.host_ip if self.real_node else "127.0.0.1"

    @property
    def pod_octet(self) -> int:
        """The second octet of this cluster's pod IPs, 1..200, derived from its state dir.

        Two clusters on one machine (the tests' and the demo's, say) share the loopback
        network: distinct ranges keep their pods' processes from fighting over an address.
        """
        return 1 + zlib.crc32(str(self.state_dir.resolve()).encode()) % 200

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pid_dir(self) -> Path:
        return self.state_dir / "pids"

    def env(self) -> dict[str, str]:
        """Environment in which kubectl and helm talk to this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's own kubectl; raises with its stderr when `check` fails."""
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if check and result.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    # -- lifecycle -----------------------------------------------------------------

    def up(self) -> None:
        if not self.bin_dir.name:
            self.bin_dir = build_binaries()
        self.down()
        # A fresh cluster: the previous one's pod folders would only mislead.
        subprocess.run(
            ["rm", "-rf", str(self.state_dir / "pods"), str(self.state_dir / "nodes")], check=True
        )
        for directory in (self.state_dir, self.log_dir, self.pid_dir):
            directory.mkdir(parents=True, exist_ok=True)
        if self.real_node:
            self.node.network_up()  # the API server binds to the node link's host side
        ports = {name: free_port() for name in ("etcd", "etcd_peer", "apiserver")}
        (self.state_dir / "ports.json").write_text(json.dumps(ports))
        self._write_pki()
        self._start_etcd(ports["etcd"], ports["etcd_peer"])
        self._start_apiserver(ports["apiserver"], ports["etcd"])
        self._write_kubeconfigs(ports["apiserver"])
        self._start_controller_manager()
        self._start_scheduler()
        if self.real_node:
            self._start_dns()
            self._start_real_node(ports["apiserver"])
        if self.nodes:
            self._start_kwok()
            self._create_nodes()

    def restart_apiserver(self, down_seconds: float) -> None:
        """Stop kube-apiserver, leave it down `down_seconds`, start it on the same port:
        every client (kubelet, controllers, the operator's watches) sees the API go away."""
        ports = json.loads((self.state_dir / "ports.json").read_text())
        self._stop_recorded(("kube-apiserver",))
        time.sleep(down_seconds)
        self._start_apiserver(ports["apiserver"], ports["etcd"])

    def down(self) -> None:
        """Stop the processes this cluster started (and only those, by their PID files)."""
        if not self.bin_dir.name:  # a `down` from another process than the `up`
            self.bin_dir = binaries_dir()
        # Workloads first (the real node and its pods, Prometheus), then the control plane
        # from the top down.
        if self.node.dir.exists():
            self.node.down(self._stop_recorded, keep_images=self.keep_images)
        for stage in _SHUTDOWN_ORDER:
            self._stop_recorded(stage)
        for child in self._children:
            child.wait()
        self._children.clear()
        # etcd's data is disposable: every `up` starts from an empty cluster.
        subprocess.run(["rm", "-rf", str(self.state_dir / "etcd")], check=True)

    def _stop_recorded(self, names: tuple[str, ...]) -> None:
        """Stop the recorded processes named (PID-file stems); "*": all but the control plane."""
        if not self.pid_dir.exists():
            return
        files = [
            f
            for f in self.pid_dir.glob("*.pid")
            if f.stem in names or ("*" in names and f.stem not in _CONTROL_PLANE | _NODE)
        ]
        pids = []
        for pid_file in files:
            pids.append(int(pid_file.read_text()))
            pid_file.unlink()
        for pid in pids:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for pid in pids:
            while _alive(pid) and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.05)
            if _alive(pid):
                _signal_group(pid, signal.SIGKILL)

    def _reap(self) -> None:
        # Our own children linger as zombies (still "alive" to kill -0) until waited on.
        for child in self._children:
            child.poll()

    # -- components ----------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], cwd: Path | None = None) -> None:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=cwd or self.state_dir,
            )
        self._children.append(process)
        (self.pid_dir / f"{name}.pid").write_text(str(process.pid))

    def _write_pki(self) -> None:
        # Every `up` is a new cluster: new addresses may need new certificates.
        subprocess.run(["rm", "-rf", str(self.pki_dir)], check=True)
        ca = CertificateAuthority(self.pki_dir)
        ca.issue(
            "apiserver",
            "kube-apiserver",
            dns_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
            ip_addresses=tuple(sorted({"127.0.0.1", "10.96.0.1", self.api_host})),
            server=True,
        )
        ca.issue("admin", "weightsync-admin", organization="system:masters")
        ca.issue("controller-manager", "system:kube-controller-manager")
        ca.issue("scheduler", "system:kube-scheduler")
        if self.real_node:
            ca.issue("kubelet", f"system:node:{NODE_NAME}", organization="system:nodes")
            ca.issue(
                "kubelet-serving",
                f"system:node:{NODE_NAME}",
                dns_names=(NODE_NAME,),
                ip_addresses=(self.node.network.node_ip,),
                server=True,
            )
            ca.issue("kube-proxy", "system:kube-proxy")
            ca.issue("apiserver-kubelet-client", "kube-apiserver", organization="system:masters")
        service_account_keys(self.pki_dir)

    def _start_etcd(self, port: int, peer_port: int) -> None:
        self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--data-dir", str(self.state_dir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{port}",
                "--advertise-client-urls", f"http://127.0.0.1:{port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
                # Tests churn objects quickly; fsync latency buys nothing for throwaway data.
                "--unsafe-no-fsync",
                "--log-level", "warn",
            ],
        )  # fmt: skip

        def healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                return bool(json.load(reply).get("health") == "true")

        _wait_until(healthy, ETCD_READY_SECONDS, "etcd", self.log_dir / "etcd.log")

    def _start_apiserver(self, port: int, etcd_port: int) -> None:
        pki = self.pki_dir
        if self.real_node:  # the `kubernetes` Service's endpoint; kubelet for logs and exec
            node_flags = [
                "--authorization-mode", "Node,RBAC",
                "--kubelet-client-certificate", str(pki / "apiserver-kubelet-client.crt"),
                "--kubelet-client-key", str(pki / "apiserver-kubelet-client.key"),
                "--kubelet-certificate-authority", str(pki / "ca.crt"),
                "--kubelet-preferred-address-types", "InternalIP",
                # Webhook Services resolve to their endpoints' pod IPs, which the host
                # routes to the node; ClusterIPs exist only inside the node's namespace.
                "--enable-aggregator-routing=true",
            ]  # fmt: skip
        else:  # Endpoints may not hold loopback addresses, and ours is 127.0.0.1.
            node_flags = ["--authorization-mode", "RBAC", "--endpoint-reconciler-type", "none"]
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
                "--bind-address", self.api_host,
                "--advertise-address", self.api_host,
                "--secure-port", str(port),
                "--tls-cert-file", str(pki / "apiserver.crt"),
                "--tls-private-key-file", str(pki / "apiserver.key"),
                "--client-ca-file", str(pki / "ca.crt"),
                "--service-account-key-file", str(pki / "sa.pub"),
                "--service-account-signing-key-file", str(pki / "sa.key"),
                "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range", SERVICE_CIDR,
                *node_flags,
                "--allow-privileged",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--v", "1",
            ],
        )  # fmt: skip
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(pki / "admin.crt", pki / "admin.key")

        def ready() -> bool:
            url = f"https://{self.api_host}:{port}/readyz"
            with urllib.request.urlopen(url, timeout=2, context=context) as reply:
                return bool(reply.status == 200)

        _wait_until(
            ready, APISERVER_READY_SECONDS, "kube-apiserver", self.log_dir / "kube-apiserver.log"
        )

    def _write_kubeconfigs(self, port: int) -> None:
        for user in ("admin", "controller-manager", "scheduler"):
            config = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "weightsync-local",
                        "cluster": {
                            "server": f"https://{self.api_host}:{port}",
                            "certificate-authority": str(self.pki_dir / "ca.crt"),
                        },
                    }
                ],
                "users": [
                    {
                        "name": user,
                        "user": {
                            "client-certificate": str(self.pki_dir / f"{user}.crt"),
                            "client-key": str(self.pki_dir / f"{user}.key"),
                        },
                    }
                ],
                "contexts": [
                    {
                        "name": "weightsync-local",
                        "context": {"cluster": "weightsync-local", "user": user},
                    }
                ],
                "current-context": "weightsync-local",
            }
            name = "kubeconfig" if user == "admin" else f"{user}.kubeconfig"
            (self.state_dir / name).write_text(yaml.safe_dump(config))

    def _start_controller_manager(self) -> None:
        kubeconfig = str(self.state_dir / "controller-manager.kubeconfig")
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                "--kubeconfig", kubeconfig,
                "--authentication-kubeconfig", kubeconfig,
                "--authorization-kubeconfig", kubeconfig,
                "--service-account-private-key-file", str(self.pki_dir / "sa.key"),
                "--root-ca-file", str(self.pki_dir / "ca.crt"),
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--bind-address", "127.0.0.1",
                "--secure-port", "0",
                # The default 20 QPS makes a fresh namespace's ServiceAccount take seconds.
                "--kube-api-qps", "200",
                "--kube-api-burst", "400",
                "--concurrent-replicaset-syncs", "10",
                "--concurrent-statefulset-syncs", "10",
            ],
        )  # fmt: skip

    def _start_scheduler(self) -> None:
        self._spawn(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                "--kubeconfig", str(self.state_dir / "scheduler.kubeconfig"),
                "--authentication-kubeconfig", str(self.state_dir / "scheduler.kubeconfig"),
                "--authorization-kubeconfig", str(self.state_dir / "scheduler.kubeconfig"),
                "--leader-elect=false",
                "--bind-address", "127.0.0.1",
                "--secure-port", "0",
                "--kube-api-qps", "200",
                "--kube-api-burst", "400",
            ],
        )  # fmt: skip

    def _start_dns(self) -> None:
        """The cluster's DNS, as every real cluster has one: CoreDNS on the node link's
        host side, which the kubelet names to every pod (`clusterDNS`). Service and pod
        names resolve; other names, and the reverse lookups c10d makes of each peer that
        connects, go to the host's resolver and fail fast. Without it the pods' resolver
        was the host's, unreachable from the pod network: each such reverse lookup timed
        out (2 x 5 s), and a group with a new agent process took 10 s to pre-warm."""
        corefile = self.state_dir / "Corefile"
        corefile.write_text(
            f""".:53 {{
    bind {self.api_host}
    errors
    cache 5
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
}}
"""
        )
        self._spawn("coredns", [str(self.bin_dir / "coredns"), "-conf", str(corefile)])

    def _start_real_node(self, port: int) -> None:
        node = self.node
        node.start(self._spawn, self.pki_dir, f"https://{self.api_host}:{port}")

        def ready() -> bool:
            result = self.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
            if result.returncode != 0:
                return False
            conditions = json.loads(result.stdout).get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        _wait_until(ready, NODE_READY_SECONDS, "the real node", self.log_dir / "kubelet.log")
        # Its GPUs: a device class, and the DRA driver that publishes them and prepares
        # the claims that name them (node/realnode.py).
        device_class = {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": GPU_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}]},
        }  # fmt: skip
        self.kubectl("apply", "-f", "-", input=json.dumps(device_class))
        node.start_gpu_driver(self._spawn, self.kubeconfig, self.gpus_per_node)

        def published() -> bool:
            result = self.kubectl("get", "resourceslices", "-o", "json", check=False)
            slices = json.loads(result.stdout).get("items", []) if result.returncode == 0 else []
            return any(s["spec"].get("nodeName") == NODE_NAME for s in slices)

        log = self.log_dir / "fake-gpu-dra.log"
        _wait_until(published, NODE_READY_SECONDS, "the GPU driver", log)

    def _start_kwok(self) -> None:
        config = self.state_dir / "kwok.yaml"
        config.write_text(kwok_stages.render(self.bin_dir / "kwok-stages"))
        self._spawn(
            "kwok",
            [
                str(self.bin_dir / "kwok"),
                "--kubeconfig", str(self.kubeconfig),
                "--config", str(config),
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector", "kwok.x-k8s.io/node=fake",
                "--node-ip", "127.0.0.1",
                "--cidr", f"127.{self.pod_octet}.0.1/24",
                "--server-address", f"127.0.0.1:{free_port()}",
            ],
        )  # fmt: skip

    def _create_nodes(self) -> None:
        nodes = [self.node_manifest(index) for index in range(self.nodes)]
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(nodes))

        def all_ready() -> bool:
            listing = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)
            ready = [
                node
                for node in listing["items"]
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in node.get("status", {}).get("conditions", [])
                )
            ]
            return len(ready) >= self.nodes

        _wait_until(all_ready, NODES_READY_SECONDS, "KWOK nodes", self.log_dir / "kwok.log")

    def node_manifest(self, index: int) -> dict[str, object]:
        """A fake GPU node; its pods get IPs in 127.<pod_octet>.<index+1>.0/24."""
        name = f"gpu-node-{index}"
        cidr = f"127.{self.pod_octet}.{index + 1}.0/24"
        resources = {
            "cpu": "64",
            "memory": "512Gi",
            "pods": "110",
            GPU_RESOURCE: str(self.gpus_per_node),
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "nvidia.com/gpu.present": "true",
                    "type": "kwok",
                },
            },
            "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "addresses": [{"type": "InternalIP", "address": f"127.0.{index + 1}.1"}],
            },
        }


_CONTROL_PLANE = {"kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"}
_NODE = {"kubelet", "kube-proxy", "containerd"}  # stopped in order by `RealNode.down`
_SHUTDOWN_ORDER: tuple[tuple[str, ...], ...] = (
    ("*",),  # Prometheus, anything else recorded
    ("kwok", "kube-scheduler", "kube-controller-manager"),
    ("kube-apiserver",),
    ("etcd",),
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group `pid` leads, or just `pid` if it leads none."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("command", choices=["up", "down", "build"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--nodes", type=int, default=2, help="fake (KWOK) nodes")
    parser.add_argument("--real-node", action="store_true", help="and one real node")
    parser.add_argument("--images", action="store_true", help="import weightsync's images")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build_binaries())
        return 0
    cluster = LocalCluster(state_dir=args.state_dir, nodes=args.nodes, real_node=args.real_node)
    if args.command == "down":
        cluster.down()
        return 0
    started = time.monotonic()
    cluster.up()
    if args.images and args.real_node:
        from tests.cluster.images import ensure_images

        for info in ensure_images(cluster.node.containerd_address).values():
            print(f"image {info.ref} on the node")
    print(f"control plane up in {time.monotonic() - started:.1f}s; KUBECONFIG={cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
