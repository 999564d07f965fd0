"""Which protocol this process's P2P pulls and holdings use: RDMA or TCP.

`spec.recovery.protocol` asks for `Auto`, `RDMA` or `TCP`; the agent resolves it once at
start (`resolve_protocol`, pure) from what it can actually use (`probe_rdma`, the only
part that reads the filesystem). What Mooncake's RDMA transport needs from the container:

* a verbs device it can open: `/sys/class/infiniband` lists the node's devices in every
  container (sysfs is not namespaced for them), so a listed device proves nothing; its
  `/dev/infiniband/uverbsN` node, which only a device plugin or DRA claim puts into the
  container, opened read-write, does;
* memory registration: `ibv_reg_mr` page-locks what it registers (a holder's host copy,
  a puller's landing buffers), so the memlock limit must be unlimited or large, or the
  process must hold `CAP_IPC_LOCK` (the sidecar's `ipcLock`);
* the Mooncake transfer engine itself (`p2p.mooncake_available`).

`Auto` falls back to TCP and says why; an explicit `RDMA` never does: it resolves to an
unusable RDMA with the reason, which the operator's RecoveryProtocol condition shows.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from weightsync.api.v1alpha1.dataplane import RecoveryProtocol

# A finite memlock limit below this cannot register one bucket (the default bucket is
# 1 GiB): RDMA would fail at the first registration, so it is not "available".
MIN_MEMLOCK_BYTES = 1 << 30
CAP_IPC_LOCK = 14  # linux/capability.h


@dataclass(frozen=True, slots=True)
class RdmaProbe:
    """What this container can use for RDMA, as `probe_rdma` found it."""

    openable: frozenset[str] = frozenset()  # verbs devices whose uverbs node opened
    listed: frozenset[str] = frozenset()  # every device sysfs lists (the node's)
    memlock_bytes: int | None = None  # the soft RLIMIT_MEMLOCK; None: unlimited
    ipc_lock: bool = False  # CAP_IPC_LOCK is effective


@dataclass(frozen=True, slots=True)
class Resolution:
    """The protocol in use, whether it can work here, and why it was chosen."""

    protocol: RecoveryProtocol  # never AUTO
    usable: bool
    detail: str


def _names(devices: Collection[str]) -> str:
    return ", ".join(sorted(devices))


def rdma_blocker(probe: RdmaProbe, named: Collection[str] = ()) -> str | None:
    """Why RDMA cannot work in this container (None: it can). `named`: the devices the
    agent is told to use (`WEIGHTSYNC_P2P_DEVICES`); empty: any it can open."""
    missing = set(named) - probe.openable
    if missing:
        return f"{_names(missing)} named in p2p_devices cannot be opened in this container"
    if not probe.openable:
        if probe.listed:
            return (
                f"the node's RDMA devices ({_names(probe.listed)}) are not in this container"
                " (no /dev/infiniband/uverbs* it can open: give it an RDMA device resource)"
            )
        return "no RDMA device"
    limited = probe.memlock_bytes is not None and probe.memlock_bytes < MIN_MEMLOCK_BYTES
    if limited and not probe.ipc_lock:
        return (
            f"the memlock limit is {probe.memlock_bytes} B and IPC_LOCK is not granted, so"
            " host memory cannot be registered (set the sidecar's ipcLock)"
        )
    return None


def resolve_protocol(
    requested: RecoveryProtocol,
    probe: RdmaProbe,
    mooncake: tuple[bool, str],
    named: Collection[str] = (),
) -> Resolution:
    """The protocol this agent serves and pulls with (see the module doc)."""
    mooncake_ok, mooncake_why = mooncake
    blocker = rdma_blocker(probe, named)
    devices = _names(set(named) or probe.openable)
    if requested is RecoveryProtocol.TCP:
        protocol, detail = RecoveryProtocol.TCP, "TCP as requested"
    elif requested is RecoveryProtocol.RDMA:
        protocol = RecoveryProtocol.RDMA
        if blocker is not None:
            return Resolution(protocol, False, f"RDMA requested, but {blocker}")
        detail = f"RDMA as requested, on {devices}"
    elif blocker is None and mooncake_ok:
        protocol, detail = RecoveryProtocol.RDMA, f"Auto: RDMA on {devices}"
    else:
        protocol = RecoveryProtocol.TCP
        detail = f"Auto: TCP, since {blocker or 'the transfer engine cannot load'}"
    if not mooncake_ok:
        return Resolution(protocol, False, f"Mooncake transfer engine unavailable: {mooncake_why}")
    return Resolution(protocol, True, detail)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _opens(node: Path) -> bool:
    try:
        fd = os.open(node, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def _ipc_lock(status: str) -> bool:
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


def probe_rdma(root: Path = Path("/")) -> RdmaProbe:
    """What this process can use for RDMA (`root`: where sysfs, /dev and /proc are; tests
    point it at a fake tree)."""
    listed = frozenset(
        p.name for p in (root / "sys/class/infiniband").glob("*") if not p.name.startswith(".")
    )
    openable = set()
    for verbs in (root / "sys/class/infiniband_verbs").glob("uverbs*"):
        device = _read(verbs / "ibdev")
        if device and _opens(root / "dev/infiniband" / verbs.name):
            openable.add(device)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return RdmaProbe(
        openable=frozenset(openable),
        listed=listed,
        memlock_bytes=None if soft == resource.RLIM_INFINITY else soft,
        ipc_lock=_ipc_lock(_read(root / "proc/self/status")),
    )
