"""`make images REGISTRY=oci:<dir>`'s push, for real: buildah writes an image into a local OCI
layout through images/build.py's `push`, the code that pushes to a user's registry.

The image is the smallest in this machine's image storage after setup, the local base
(about 180 MB; about 10 s on two cores): what is pushed matters less than that the
transport, the name and the reported digest are what a user gets. tests/unit/images/
test_publish.py covers the commands around it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from images.build import SPECS, destination, push
from tests.cluster.images import BUILDAH, base_image


def test_an_image_pushed_into_an_oci_layout_is_there_under_its_name(tmp_path: Path) -> None:
    layout = tmp_path / "publish" / "layout"  # parents made by `push`, not by the test
    target = destination(f"oci:{layout}", SPECS["operator"], "0.0.0-test")
    try:
        digest = push(base_image(), target, buildah=BUILDAH)

        [entry] = json.loads((layout / "index.json").read_text())["manifests"]
        assert entry["digest"] == digest
        assert entry["annotations"]["org.opencontainers.image.ref.name"] == (
            "weightsync/operator:0.0.0-test"
        )
        blobs = layout / "blobs" / "sha256"
        manifest = (blobs / digest.removeprefix("sha256:")).read_bytes()
        assert f"sha256:{hashlib.sha256(manifest).hexdigest()}" == digest
        referenced = [json.loads(manifest)["config"], *json.loads(manifest)["layers"]]
        for blob in referenced:
            path = blobs / blob["digest"].removeprefix("sha256:")
            assert path.stat().st_size == blob["size"], blob["digest"]
    finally:  # tens of MB: not left for pytest's kept temp folders
        shutil.rmtree(tmp_path / "publish", ignore_errors=True)
