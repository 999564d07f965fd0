"""Tiny OCI images written by hand: the node's pause image and test images.

No registry is reachable here, and the pause image (the process that holds a pod's
namespaces) is one static binary, so it is packed directly: one uncompressed layer, a
config, a manifest and an index in an OCI image layout tar, named by the
`io.containerd.image.name` annotation that `ctr images import` reads.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

_LAYER = "application/vnd.oci.image.layer.v1.tar"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_INDEX = "application/vnd.oci.image.index.v1+json"


@dataclass(frozen=True, slots=True)
class Entry:
    """A file, a directory (`data` None, no `link`) or a symlink (`link`) in the layer."""

    path: str
    data: bytes | None = None
    mode: int = 0o755
    link: str | None = None


def normalized(ref: str) -> str:
    """The reference as containerd and the kubelet spell it (`docker.io/library/...`)."""
    name = ref
    first = name.split("/", 1)[0]
    if "/" not in name or ("." not in first and ":" not in first and first != "localhost"):
        name = f"docker.io/{name}" if "/" in name else f"docker.io/library/{name}"
    if ":" not in name.rsplit("/", 1)[-1] and "@" not in name:
        name += ":latest"
    return name


def _layer(entries: list[Entry]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(entries, key=lambda e: e.path):
            info = tarfile.TarInfo(entry.path.lstrip("/"))
            info.mode = entry.mode
            info.mtime = 0  # reproducible: the same files make the same digest
            if entry.link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, entry.link
                tar.addfile(info)
            elif entry.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
    return buffer.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size, info.mtime = len(data), 0
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}", len(data)


def write_archive(
    out: Path,
    ref: str,
    entries: list[Entry],
    *,
    entrypoint: list[str],
    user: str = "",
    env: list[str] | None = None,
) -> str:
    """Write an OCI image layout tar for `ref`; return the manifest's digest."""
    layer = _layer(entries)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "User": user, "Env": env or []},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, mode="w") as tar:
        layer_digest, layer_size = _blob(tar, layer)
        config_digest, config_size = _blob(tar, json.dumps(config).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": _MANIFEST,
            "config": {"mediaType": _CONFIG, "digest": config_digest, "size": config_size},
            "layers": [{"mediaType": _LAYER, "digest": layer_digest, "size": layer_size}],
        }
        manifest_digest, manifest_size = _blob(tar, json.dumps(manifest).encode())
        index = {
            "schemaVersion": 2,
            "mediaType": _INDEX,
            "manifests": [
                {
                    "mediaType": _MANIFEST,
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {"io.containerd.image.name": normalized(ref)},
                }
            ],
        }
        for name, payload in (
            ("oci-layout", {"imageLayoutVersion": "1.0.0"}),
            ("index.json", index),
        ):
            data = json.dumps(payload).encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return manifest_digest
