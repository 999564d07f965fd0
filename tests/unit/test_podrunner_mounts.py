"""A container's mounts: a volume at /tmp must not hide the sources of later mounts."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.cluster import podrunner, podspec


def test_nested_mounts_over_a_parent_of_their_sources(tmp_path: Path) -> None:
    outer, inner = tmp_path / "outer", tmp_path / "inner"
    outer.mkdir()
    inner.mkdir()
    (outer / "f").write_text("outer")
    (inner / "g").write_text("inner")
    # tmp_path lives under /tmp: mounting `outer` at /tmp hides it unless staged first.
    launch = podspec.ContainerLaunch(
        "c",
        ["sh", "-c", "cat /tmp/f /tmp/nested/g"],
        {"PATH": "/usr/bin:/bin"},
        [(inner, "/tmp/nested"), (outer, "/tmp")],
    )
    result = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            podrunner.mount_script(launch),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "outerinner"


def test_host_paths_hidden_by_a_volume_are_bound_back(tmp_path: Path) -> None:
    volume, checkout = tmp_path / "volume", tmp_path / "checkout"
    volume.mkdir()
    checkout.mkdir()
    (checkout / "tool").write_text("from the host")
    # A volume at /tmp hides tmp_path (under /tmp); the checkout must stay visible.
    launch = podspec.ContainerLaunch(
        "c", ["cat", str(checkout / "tool")], {"PATH": "/usr/bin:/bin"}, [(volume, "/tmp")]
    )
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         podrunner.mount_script(launch, [checkout])],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "from the host"
