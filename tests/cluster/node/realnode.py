"""A real Kubernetes node on this machine: kubelet, containerd + runc, CNI, kube-proxy, and
a DRA driver for its fake GPUs.

    host network namespace                 node network namespace `wsnode<n>`
    kube-apiserver on 10.250.<n>.1  <-veth->  10.250.<n>.2  kubelet, kube-proxy,
    test process, route to pod CIDR           containerd --CNI bridge cni0-- pods
                                              (10.<120+n>.0.0/16, one netns each)

The node's daemons run in a network namespace of their own, entered with `nsenter
--net` only (the mount namespace stays the host's, where containerd mounts rootfs and
volumes and the kubelet finds them). So two clusters on one machine never share a
bridge, an nftables table or an address, and the network side of teardown is deleting
one namespace. Everything else the node creates lives under `<state>/node/` (containerd
root and state, kubelet root, pod logs, CNI config and IPAM) or is recorded in `host.py`.

Facts measured on these machines that the configuration answers:
* runc, not crun: crun fails on these hybrid cgroups (v1 controllers plus a v2
  `unified` mount, no systemd as init); the kubelet uses the cgroupfs driver.
* `restrict_oom_score_adj = true`: the VM refuses to lower `oom_score_adj`, and runc
  then fails with "can't get final child's PID from pipe".
* No registry is reachable: the sandbox (pause) image is built here (`pause.c`, packed
  by `oci.py`) and every image is imported, so pods use `imagePullPolicy: Never` or
  `IfNotPresent`.
* GPUs are fake, allocated for real: `fake-gpu-dra` (built beside the kubelet) is a
  Dynamic Resource Allocation driver that publishes the node's GPUs as a ResourceSlice
  and prepares claims with CDI specs that containerd applies (containerd 2, built with
  the control plane: Debian's 1.6 predates CDI). A container naming a claim gets
  `FAKE_GPU_<index>=<uuid>` for each allocated device, and nothing for the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.cluster.node import configs, host, oci

HERE = Path(__file__).resolve().parent
CLUSTER_DOMAIN = "cluster.local"
NODE_NAME = "node-0"
GPU_DRIVER = "gpu.fake.weightsync.io"  # fake-gpu-dra's driver name and device class
MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path, less its NUL)
NODE_LABEL = "weightsync.io/local-node"  # on the real node, for pods that must run
SERVICE_CIDR = "10.96.0.0/16"
NETWORKS = 120  # node network slots on one machine

# How long each piece may take before `up` gives up (a loaded 2-core machine).
CONTAINERD_READY_SECONDS = 60
NODE_READY_SECONDS = 120
STOP_SECONDS = 20


class NodeError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Network:
    """The addresses of node slot `index` (1..NETWORKS)."""

    index: int

    @property
    def netns(self) -> str:
        return f"wsnode{self.index}"

    @property
    def host_link(self) -> str:
        return f"wsh{self.index}"

    @property
    def host_ip(self) -> str:
        return f"10.250.{self.index}.1"

    @property
    def node_ip(self) -> str:
        return f"10.250.{self.index}.2"

    @property
    def pod_cidr(self) -> str:
        return f"10.{120 + self.index}.0.0/16"

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.netns


def _run(*argv: str, check: bool = True, timeout: float = 60) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise NodeError(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class RealNode:
    """One real node of the cluster whose state lives in `state_dir`.

    `down()` needs nothing but the state directory, so a later process (`make
    demo-down`) can stop a node started by another.
    """

    def __init__(
        self, state_dir: Path, bin_dir: Path, cache_dir: Path, images_dir: Path | None = None
    ) -> None:
        self.state_dir = state_dir
        self.bin_dir = bin_dir
        self.cache_dir = cache_dir
        self.dir = state_dir / "node"
        # containerd's root (its images and snapshots): under the node's folder unless
        # given; nodes that run one after the other may share one and import once.
        self.containerd_root = images_dir or self.dir / "containerd" / "root"
        self.ledger = host.SysctlLedger(cache_dir / "node-host")
        self._network: Network | None = None

    # -- paths ---------------------------------------------------------------------

    @property
    def containerd_address(self) -> Path:
        return self.dir / "run" / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.containerd_address}"

    @property
    def pod_logs(self) -> Path:
        return self.dir / "pod-logs"

    @property
    def network(self) -> Network:
        if self._network is None:
            self._network = self._recorded_network() or self._allocate_network()
        return self._network

    @property
    def cgroup_root(self) -> str:
        return f"weightsync-{self.network.netns}"

    def _recorded_network(self) -> Network | None:
        recorded = self.dir / "network.json"
        if recorded.exists():
            return Network(int(json.loads(recorded.read_text())["index"]))
        return None

    def _allocate_network(self) -> Network:
        """A free slot, starting from one derived from the state dir (stable per cluster)."""
        start = zlib.crc32(str(self.state_dir.resolve()).encode()) % NETWORKS
        for step in range(NETWORKS):
            network = Network(1 + (start + step) % NETWORKS)
            if not network.netns_path.exists():
                self.dir.mkdir(parents=True, exist_ok=True)
                (self.dir / "network.json").write_text(json.dumps({"index": network.index}))
                return network
        raise NodeError(f"all {NETWORKS} node network slots are in use")

    def ctr(self, *args: str, timeout: float = 600) -> str:
        """containerd's own CLI against this node's containerd, in the kubelet's namespace."""
        return _run("ctr", "--address", str(self.containerd_address), "-n", "k8s.io", *args,
                    timeout=timeout)  # fmt: skip

    def containers(self) -> list[dict[str, object]]:
        """The node's containers (namespace, pod, container, id, state, attempt, pid)."""
        out = _run(str(self.bin_dir / "crictl-lite"), "-endpoint", self.endpoint, "containers")
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    # -- up ------------------------------------------------------------------------

    def network_up(self) -> Network:
        """The namespace, the veth pair and the routes; before the API server binds."""
        net = self.network
        if net.netns_path.exists():
            self.network_down()
        _run("ip", "netns", "add", net.netns)
        _run("ip", "link", "add", net.host_link, "type", "veth", "peer", "name", "eth0",
             "netns", net.netns)  # fmt: skip
        _run("ip", "addr", "add", f"{net.host_ip}/30", "dev", net.host_link)
        _run("ip", "link", "set", net.host_link, "up")
        inside = ("ip", "netns", "exec", net.netns)
        _run(*inside, "ip", "addr", "add", f"{net.node_ip}/30", "dev", "eth0")
        _run(*inside, "ip", "link", "set", "eth0", "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "ip", "route", "add", "default", "via", net.host_ip)
        # Forwarding between the bridge and the uplink, inside the node's namespace only.
        _run(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run(*inside, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")
        _run("ip", "route", "add", net.pod_cidr, "via", net.node_ip, "dev", net.host_link)
        return net

    def network_down(self) -> None:
        net = self.network
        if net.netns_path.exists():
            _run("ip", "netns", "del", net.netns, check=False)
        # The host end goes with its peer; a half-made pair from a failed `up` may not.
        _run("ip", "link", "del", net.host_link, check=False)

    def start(self, spawn: Callable[[str, list[str]], None], pki: Path, server: str) -> None:
        """containerd, the pause image, the kubelet and kube-proxy (network_up first)."""
        for sub in ("run", "containerd", "cni/net.d", "cni/ipam", "kubelet", "pod-logs", "cdi"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._write_cni_config()
        config = self._write_containerd_config()
        nsenter = ["nsenter", f"--net={self.network.netns_path}"]
        # Its runc shim from the same build, found on PATH.
        path = f"PATH={self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        containerd = [str(self.bin_dir / "containerd"), "--config", str(config)]
        spawn("containerd", [*nsenter, "env", path, *containerd])
        self._wait(self._containerd_ready, CONTAINERD_READY_SECONDS, "containerd")
        self.import_archive(self._pause_archive())
        self.ledger.register(self.network.netns)
        host.create_cgroup_root(self.cgroup_root)
        kubelet_args = self._write_kubelet_config(pki, server)
        spawn("kubelet", [*nsenter, str(self.bin_dir / "kubelet"), *kubelet_args])
        proxy_config = self._write_proxy_config(pki, server)
        spawn("kube-proxy", [*nsenter, str(self.bin_dir / "kube-proxy"), "--config",
                             str(proxy_config)])  # fmt: skip

    def start_gpu_driver(self, spawn: Callable[[str, list[str]], None], kubeconfig: Path,
                         gpus: int) -> None:  # fmt: skip
        """The DRA driver of the node's `gpus` fake GPUs (the kubelet must be up: it
        registers through the kubelet's plugin directory)."""
        kubelet = self.dir / "kubelet"
        for socket in (
            kubelet / "plugins_registry" / "gpu-reg.sock",
            self.dir / "dra" / "dra.sock",
        ):
            if len(str(socket)) > MAX_SOCKET_PATH:
                raise NodeError(f"{socket}: longer than a Unix socket's {MAX_SOCKET_PATH} bytes;"
                                " put the cluster's state in a shorter directory")  # fmt: skip
        spawn("fake-gpu-dra", [
            str(self.bin_dir / "fake-gpu-dra"), "--kubeconfig", str(kubeconfig),
            "--node-name", NODE_NAME, "--gpus", str(gpus),
            "--registrar-dir", str(kubelet / "plugins_registry"),
            "--plugin-dir", str(self.dir / "dra"),
            "--cdi-dir", str(self.dir / "cdi"),
        ])  # fmt: skip

    def import_archive(self, archive: Path) -> None:
        self.ctr("images", "import", str(archive))

    def _containerd_ready(self) -> bool:
        if not self.containerd_address.exists():
            return False
        result = subprocess.run(
            ["ctr", "--address", str(self.containerd_address), "version"],
            capture_output=True,
            check=False,
            timeout=10,
        )
        return result.returncode == 0

    def _wait(self, check: Callable[[], bool], seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.3)
        log = self.state_dir / "logs" / f"{what}.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
        raise NodeError(f"{what} not ready after {seconds:.0f}s\n{tail}")

    def _pause_archive(self) -> Path:
        """The sandbox image, compiled and packed once per source (cached)."""
        source = HERE / "pause.c"
        key = zlib.crc32(source.read_bytes() + (HERE / "oci.py").read_bytes())
        archive = self.cache_dir / "node-images" / f"pause-{key:08x}.tar"
        if not archive.exists():
            binary = archive.with_suffix(".bin")
            binary.parent.mkdir(parents=True, exist_ok=True)
            _run("gcc", "-Os", "-static", "-o", str(binary), str(source))
            _run("strip", str(binary))
            entries = [oci.Entry("pause", binary.read_bytes(), 0o755)]
            oci.write_archive(archive.with_suffix(".tmp"), configs.PAUSE_IMAGE, entries,
                              entrypoint=["/pause"], user="65535:65535")  # fmt: skip
            archive.with_suffix(".tmp").rename(archive)
            binary.unlink()
        return archive

    def _write_cni_config(self) -> None:
        path = self.dir / "cni" / "net.d" / "10-weightsync.conflist"
        path.write_text(json.dumps(configs.cni(self.network.pod_cidr, self.dir / "cni" / "ipam")))

    def _write_containerd_config(self) -> Path:
        path = self.dir / "containerd.toml"
        path.write_text(configs.containerd(self.dir, self.containerd_root, self.containerd_address))
        return path

    def _kubeconfig(self, pki: Path, server: str, user: str) -> Path:
        path = self.dir / f"{user}.kubeconfig"
        path.write_text(yaml.safe_dump(configs.kubeconfig(pki, server, user)))
        return path

    def _write_kubelet_config(self, pki: Path, server: str) -> list[str]:
        path = self.dir / "kubelet.yaml"
        config = configs.kubelet(
            self.network.node_ip,
            pki,
            f"/{self.cgroup_root}",
            self.endpoint,
            self.pod_logs,
            cluster_dns=self.network.host_ip,  # CoreDNS there (`LocalCluster._start_dns`)
            cluster_domain=CLUSTER_DOMAIN,
        )
        path.write_text(yaml.safe_dump(config))
        kubeconfig = self._kubeconfig(pki, server, "kubelet")
        return [
            "--config", str(path),
            "--kubeconfig", str(kubeconfig),
            "--root-dir", str(self.dir / "kubelet"),
            "--hostname-override", NODE_NAME,
            "--node-ip", self.network.node_ip,
            "--node-labels", f"{NODE_LABEL}=true",
            "--v", "1",
        ]  # fmt: skip

    def _write_proxy_config(self, pki: Path, server: str) -> Path:
        kubeconfig = self._kubeconfig(pki, server, "kube-proxy")
        config = configs.kube_proxy(kubeconfig, NODE_NAME, self.network)
        path = self.dir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    # -- down ----------------------------------------------------------------------

    def down(self, stop: Callable[[tuple[str, ...]], None], *, keep_images: bool) -> None:
        """Undo everything `network_up` and `start` did (see the module doc).

        `stop` stops recorded processes by name. With `keep_images`, containerd's content
        store survives (a warm start then imports nothing).
        """
        if not self.dir.exists():
            return
        stop(("kube-proxy", "kubelet"))
        if self._containerd_ready():
            try:  # each pod's network torn down through CNI, each sandbox's mounts
                _run(str(self.bin_dir / "crictl-lite"), "-endpoint", self.endpoint, "reset",
                     timeout=120)  # fmt: skip
            except (NodeError, subprocess.TimeoutExpired) as exc:
                print(f"node reset incomplete, sweeping instead: {exc}")
        stop(("containerd",))
        marker = str(self.containerd_address)
        for pid in host.processes_with(marker):  # shims of a containerd that died
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        host.unmount_under(self.dir)
        host.remove_cgroup_root(self.cgroup_root)
        host.remove_log_links(self.dir)
        self.network_down()
        self.ledger.release(self.network.netns)
        keep = {"network.json"} | ({"containerd"} if keep_images else set())
        for entry in self.dir.iterdir():
            if entry.name in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                subprocess.run(["rm", "-rf", str(entry)], check=False)
            else:
                entry.unlink()
        if keep_images:
            state = self.dir / "containerd" / "state"
            subprocess.run(["rm", "-rf", str(state)], check=False)
