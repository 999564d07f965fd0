"""What a real node changes on this machine, and how `down` puts it back.

A node runs in a network namespace of its own (so its CNI bridge, kube-proxy's
nftables tables and its routes never meet another cluster's), but some things it
touches are machine-wide: cgroups, mounts under its state directory, the kubelet's
sysctls and its `/var/log/containers` links. Each is recorded or derivable here and
undone by `down`, whatever state the node's processes were left in.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTAINER_LOG_LINKS = Path("/var/log/containers")

# The kernel settings the kubelet writes at start (pkg/kubelet/cm: setupKernelTunables).
KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    return {name: _sysctl_path(name).read_text().strip() for name in KUBELET_SYSCTLS}


class SysctlLedger:
    """The machine's values before the first node started, restored after the last.

    Nodes register by name; the ledger file holds the original values while any
    registered node's network namespace still exists.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.originals = directory / "sysctls.json"
        self.members = directory / "nodes"

    def _alive(self) -> list[str]:
        if not self.members.exists():
            return []
        return [p.name for p in self.members.iterdir() if Path("/run/netns", p.name).exists()]

    def register(self, node: str) -> None:
        self.members.mkdir(parents=True, exist_ok=True)
        if not self._alive() or not self.originals.exists():
            self.originals.write_text(json.dumps(read_sysctls()))
        (self.members / node).touch()

    def release(self, node: str) -> None:
        (self.members / node).unlink(missing_ok=True)
        if self._alive() or not self.originals.exists():
            return
        for name, value in json.loads(self.originals.read_text()).items():
            with contextlib.suppress(OSError):
                _sysctl_path(name).write_text(value)
        self.originals.unlink()


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, the named systemd one, unified)."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, kind, *_ = line.split()
        if kind in ("cgroup", "cgroup2") and target.startswith(str(CGROUP_ROOT)):
            found.append(Path(target))
    return found


def create_cgroup_root(name: str) -> None:
    """The kubelet's `--cgroup-root`, which it requires to exist in every hierarchy."""
    for hierarchy in cgroup_hierarchies():
        path = hierarchy / name
        path.mkdir(exist_ok=True)
        if (hierarchy / "cpuset.cpus").exists():  # v1 cpuset starts empty: inherit
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (path / knob).write_text((hierarchy / knob).read_text())


def remove_cgroup_root(name: str) -> None:
    """Remove the root's tree, deepest first; a cgroup with tasks left is reported."""
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / name
        if not top.exists():
            continue
        for directory, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
            with contextlib.suppress(FileNotFoundError):
                Path(directory).rmdir()


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below `directory`, deepest first."""
    prefix = str(directory.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=len, reverse=True)


def unmount_under(directory: Path) -> None:
    for point in mounts_under(directory):
        result = subprocess.run(["umount", point], capture_output=True, check=False)
        if result.returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def log_links_into(directory: Path) -> list[Path]:
    """The kubelet's `/var/log/containers/*.log` links into `directory` (a node's)."""
    if not CONTAINER_LOG_LINKS.exists():
        return []
    prefix = str(directory.resolve())
    return [
        link
        for link in CONTAINER_LOG_LINKS.iterdir()
        if link.is_symlink() and os.readlink(link).startswith(prefix)
    ]


def remove_log_links(directory: Path) -> None:
    """The kubelet's `/var/log/containers/*.log` links into this node's pod logs."""
    for link in log_links_into(directory):
        link.unlink(missing_ok=True)


def processes_with(marker: str) -> list[int]:
    """PIDs whose command line mentions `marker` (a path only this node uses)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids
