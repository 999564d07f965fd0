"""The real node's configuration files, as data: CNI, containerd, kubeconfigs, the kubelet
and kube-proxy (`realnode.RealNode` writes them). Pure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.cluster.node import oci

if TYPE_CHECKING:
    from tests.cluster.node.realnode import Network

CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
PAUSE_IMAGE = "weightsync.local/pause:3.10"


def cni(pod_cidr: str, ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "weightsync-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,  # the host routes the pod CIDR back to this namespace
                "hairpinMode": True,  # a pod reaching itself through its Service
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "loopback"},
        ],
    }


def containerd(node_dir: Path, root: Path, address: Path) -> str:
    """containerd 2's config (version 3): CDI on, for the node's DRA driver's specs."""
    runtime = {
        "restrict_oom_score_adj": True,
        "enable_cdi": True,
        "cdi_spec_dirs": [str(node_dir / "cdi")],
        "containerd": {
            "default_runtime_name": "runc",
            "runtimes": {
                "runc": {
                    "runtime_type": "io.containerd.runc.v2",
                    "options": {"BinaryName": "runc", "SystemdCgroup": False},
                }
            },
        },
        "cni": {"bin_dirs": [str(CNI_BIN_DIR)], "conf_dir": str(node_dir / "cni" / "net.d")},
    }
    images = {
        "snapshotter": "overlayfs",
        "pinned_images": {"sandbox": oci.normalized(PAUSE_IMAGE)},
    }
    config = {
        "version": 3,
        "root": str(root),
        "state": str(node_dir / "containerd" / "state"),
        "grpc": {"address": str(address)},
        "ttrpc": {"address": str(address) + ".ttrpc"},
        "metrics": {"address": ""},
        "plugins": {
            "io.containerd.cri.v1.runtime": runtime,
            "io.containerd.cri.v1.images": images,
            "io.containerd.grpc.v1.cri": {
                "stream_server_address": "127.0.0.1",
                "stream_server_port": "0",
            },
            "io.containerd.internal.v1.opt": {"path": str(node_dir / "containerd" / "opt")},
        },
    }
    return _toml(config)


def kubeconfig(pki: Path, server: str, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server,
                                          "certificate-authority": str(pki / "ca.crt")}}
        ],
        "users": [
            {"name": user, "user": {"client-certificate": str(pki / f"{user}.crt"),
                                    "client-key": str(pki / f"{user}.key")}}
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }  # fmt: skip


def kubelet(
    node_ip: str,
    pki: Path,
    cgroup_root: str,
    endpoint: str,
    pod_logs: Path,
    *,
    cluster_dns: str,
    cluster_domain: str,
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node_ip,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {
            "x509": {"clientCAFile": str(pki / "ca.crt")},
            "webhook": {"enabled": True},
            "anonymous": {"enabled": False},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "failCgroupV1": False,  # these machines mount v1 controllers (hybrid)
        "containerRuntimeEndpoint": endpoint,
        "podLogsDir": str(pod_logs),
        "failSwapOn": False,
        "resolvConf": "/etc/resolv.conf",  # dnsPolicy Default pods; CoreDNS forwards to it
        "clusterDNS": [cluster_dns],
        "clusterDomain": cluster_domain,
        # A shared test machine: never evict or collect images because of disk use.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "maxPods": 110,
        "syncFrequency": "5s",  # projected Secrets reach running pods within seconds
        # A container killed again and again (the chaos run kills one agent up to 20
        # times) comes back within 10 s, not after the default back-off that doubles
        # to 5 min: the tests time weightsync's recovery, not the kubelet's back-off.
        "featureGates": {"KubeletCrashLoopBackOffMax": True},
        "crashLoopBackOff": {"maxContainerRestartPeriod": "10s"},
    }


def kube_proxy(kubeconfig_path: Path, node_name: str, network: Network) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "clientConnection": {"kubeconfig": str(kubeconfig_path)},
        "hostnameOverride": node_name,
        "clusterCIDR": network.pod_cidr,
        "bindAddress": network.node_ip,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # Conntrack limits are machine-wide sysctls: leave them alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }


def _toml(value: dict[str, object], prefix: str = "") -> str:
    """Just enough TOML for containerd's config (strings, numbers, booleans, lists of
    strings, tables)."""
    lines: list[str] = []
    tables: list[tuple[str, dict[str, object]]] = []
    for key, item in value.items():
        if isinstance(item, dict):
            tables.append((key, item))
        elif isinstance(item, bool):  # before int: a bool is an int
            lines.append(f"{key} = {'true' if item else 'false'}")
        elif isinstance(item, int):
            lines.append(f"{key} = {item}")
        elif isinstance(item, list):
            lines.append(f"{key} = {json.dumps([str(x) for x in item])}")
        else:
            lines.append(f"{key} = {json.dumps(str(item))}")
    out = "\n".join(lines) + "\n" if lines else ""
    for key, table in tables:
        name = f"{prefix}.{json.dumps(key) if '.' in key else key}".lstrip(".")
        body = _toml(table, name)
        out += f"\n[{name}]\n{body}"
    return out
