"""A busybox image for the node's own tests, packed from Debian's static busybox.

Enough userland for a shell, an HTTP server (`httpd`), `wget` and `df`; the real
product images come from `images/` (see tests/cluster/images.py).
"""

from __future__ import annotations

import subprocess
import zlib
from pathlib import Path

from tests.cluster.node import oci

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static
REF = "weightsync.local/busybox:test"


def busybox_archive(cache_dir: Path) -> Path:
    binary = BUSYBOX.read_bytes()
    archive = cache_dir / "node-images" / f"busybox-{zlib.crc32(binary):08x}.tar"
    if archive.exists():
        return archive
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    entries = [
        oci.Entry("bin"),
        oci.Entry("tmp", mode=0o1777),
        oci.Entry("etc"),
        oci.Entry("etc/passwd", b"root:x:0:0::/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n", 0o644),
        oci.Entry("bin/busybox", binary, 0o755),
    ]
    entries += [oci.Entry(f"bin/{name}", link="busybox") for name in applets if name != "busybox"]
    partial = archive.with_suffix(".tmp")
    oci.write_archive(partial, REF, entries, entrypoint=["/bin/sh"])
    partial.rename(archive)
    return archive
