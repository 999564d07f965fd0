"""The P2P protocol an agent resolves: Auto from what the container can use, explicit
choices as asked (RDMA never falling back), and the probe that finds the devices."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from weightsync.api.v1alpha1.dataplane import RecoveryProtocol
from weightsync.transfer.p2p_protocol import (
    MIN_MEMLOCK_BYTES,
    RdmaProbe,
    Resolution,
    probe_rdma,
    rdma_blocker,
    resolve_protocol,
)

AUTO, RDMA, TCP = RecoveryProtocol.AUTO, RecoveryProtocol.RDMA, RecoveryProtocol.TCP
MOONCAKE = (True, "mooncake transfer engine")
NO_MOONCAKE = (False, "libibverbs.so.1: cannot open shared object file")
NIC = RdmaProbe(openable=frozenset({"mlx5_0"}), listed=frozenset({"mlx5_0", "mlx5_1"}))
HOST_ONLY = RdmaProbe(listed=frozenset({"mlx5_0"}))  # sysfs shows the node's, no uverbs
LOCKED = RdmaProbe(openable=frozenset({"mlx5_0"}), memlock_bytes=64 << 10)  # 64 KiB
LOCKED_WITH_CAP = RdmaProbe(openable=frozenset({"mlx5_0"}), memlock_bytes=64 << 10, ipc_lock=True)
BIG_LIMIT = RdmaProbe(openable=frozenset({"mlx5_0"}), memlock_bytes=MIN_MEMLOCK_BYTES)


@pytest.mark.parametrize(
    ("requested", "probe", "mooncake", "named", "protocol", "usable", "why"),
    [
        # Auto: RDMA only where a device opens, memory registers and Mooncake loads.
        (AUTO, NIC, MOONCAKE, (), RDMA, True, "Auto: RDMA on mlx5_0"),
        (AUTO, BIG_LIMIT, MOONCAKE, (), RDMA, True, "Auto: RDMA"),
        (AUTO, LOCKED_WITH_CAP, MOONCAKE, (), RDMA, True, "Auto: RDMA"),
        (AUTO, RdmaProbe(), MOONCAKE, (), TCP, True, "Auto: TCP, since no RDMA device"),
        (AUTO, HOST_ONLY, MOONCAKE, (), TCP, True, "are not in this container"),
        (AUTO, LOCKED, MOONCAKE, (), TCP, True, "memlock limit is 65536 B"),
        (AUTO, NIC, MOONCAKE, ("mlx5_1",), TCP, True, "mlx5_1 named in p2p_devices"),
        (AUTO, NIC, MOONCAKE, ("mlx5_0",), RDMA, True, "Auto: RDMA on mlx5_0"),
        (AUTO, NIC, NO_MOONCAKE, (), TCP, False, "Mooncake transfer engine unavailable"),
        (AUTO, RdmaProbe(), NO_MOONCAKE, (), TCP, False, "libibverbs"),
        # RDMA as asked, or unusable with the reason: never TCP behind the user's back.
        (RDMA, NIC, MOONCAKE, (), RDMA, True, "RDMA as requested, on mlx5_0"),
        (RDMA, RdmaProbe(), MOONCAKE, (), RDMA, False, "RDMA requested, but no RDMA device"),
        (RDMA, HOST_ONLY, MOONCAKE, (), RDMA, False, "are not in this container"),
        (RDMA, LOCKED, MOONCAKE, (), RDMA, False, "ipcLock"),
        (RDMA, NIC, MOONCAKE, ("mlx5_1",), RDMA, False, "mlx5_1 named in p2p_devices"),
        (RDMA, NIC, NO_MOONCAKE, (), RDMA, False, "Mooncake transfer engine unavailable"),
        # TCP as asked, whatever devices there are.
        (TCP, NIC, MOONCAKE, (), TCP, True, "TCP as requested"),
        (TCP, RdmaProbe(), MOONCAKE, (), TCP, True, "TCP as requested"),
        (TCP, RdmaProbe(), NO_MOONCAKE, (), TCP, False, "unavailable"),
    ],
)
def test_resolution(
    *,
    requested: RecoveryProtocol,
    probe: RdmaProbe,
    mooncake: tuple[bool, str],
    named: tuple[str, ...],
    protocol: RecoveryProtocol,
    usable: bool,
    why: str,
) -> None:
    resolution = resolve_protocol(requested, probe, mooncake, named)
    assert (resolution.protocol, resolution.usable) == (protocol, usable)
    assert why in resolution.detail
    assert resolution.protocol is not AUTO


def test_an_unlimited_memlock_needs_no_capability() -> None:
    unlimited = RdmaProbe(openable=frozenset({"mlx5_0"}), memlock_bytes=None)
    assert rdma_blocker(unlimited) is None
    assert rdma_blocker(LOCKED) is not None


def _fake_node(root: Path, *, opened: dict[str, str], listed: list[str], cap_eff: str) -> None:
    """sysfs, /dev and /proc as a container sees them: `opened` maps uverbs nodes that
    exist under /dev to their device; `listed` are every device sysfs shows."""
    for device in listed:
        (root / "sys/class/infiniband" / device).mkdir(parents=True)
    (root / "dev/infiniband").mkdir(parents=True)
    for index, device in enumerate(listed):
        verbs = root / f"sys/class/infiniband_verbs/uverbs{index}"
        verbs.mkdir(parents=True)
        (verbs / "ibdev").write_text(f"{device}\n")
    for node in opened:
        (root / "dev/infiniband" / node).write_bytes(b"")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/status").write_text(f"Name:\tagent\nCapEff:\t{cap_eff}\n")


def test_the_probe_counts_only_devices_whose_verbs_node_opens(tmp_path: Path) -> None:
    # The node has two NICs; the device plugin gave this container the second one only.
    _fake_node(tmp_path, opened={"uverbs1": "mlx5_1"}, listed=["mlx5_0", "mlx5_1"], cap_eff="4000")
    probe = probe_rdma(tmp_path)
    assert probe.listed == {"mlx5_0", "mlx5_1"}
    assert probe.openable == {"mlx5_1"}
    assert probe.ipc_lock  # bit 14 of CapEff
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert probe.memlock_bytes == (None if soft == resource.RLIM_INFINITY else soft)


def test_the_probe_of_a_container_without_rdma(tmp_path: Path) -> None:
    _fake_node(tmp_path, opened={}, listed=["mlx5_0"], cap_eff="00000000a80425fb")
    probe = probe_rdma(tmp_path)
    assert probe.openable == frozenset()
    assert probe.listed == {"mlx5_0"}
    assert not probe.ipc_lock  # Docker's default set has no IPC_LOCK
    assert resolve_protocol(AUTO, probe, MOONCAKE) == Resolution(
        TCP,
        True,
        "Auto: TCP, since the node's RDMA devices (mlx5_0) are not in this container"
        " (no /dev/infiniband/uverbs* it can open: give it an RDMA device resource)",
    )
    assert probe_rdma(tmp_path / "nothing-here").openable == frozenset()
