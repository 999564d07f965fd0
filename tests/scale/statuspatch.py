"""`python -m tests.scale status-patch`: what a 1,001-member status write costs the API server.

One local control plane (no nodes, no operator). The WeightSync CRD as shipped, where
`status.members` is an atomic list, and the same CRD with members as a list-type map
keyed by rank (as it was before), take turns: each variant gets a fresh WeightSync whose
status is merge-patched `--patches` times (every member's version moves each time, as a
round does), the way the operator writes it (`ApiWriter.patch_status`). Printed per
variant: the patch's p50 and max (the first five left out: the API server warms up),
the size of the object's `metadata.managedFields`, and what parsing the WeightSync
without its status costs with and without those records; then the ratio of the two
variants' p50, the map's to the shipped one's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from tests.cluster.controlplane import LocalCluster, build_binaries
from tests.support.operator import CRD_FILE
from tests.unit.api.builders import weightsync
from weightsync.api import GROUP, PLURAL, VERSION, parse_weightsync
from weightsync.controller.cluster.apiwriter import ApiWriter
from weightsync.controller.passes.observe import without_status

NAMESPACE = "status-patch"
WARM_UP = 5  # patches left out of the figures


def member(rank: int, version: int) -> dict[str, Any]:
    role = "Sink" if rank else "Source"
    node = f"gpu-node-{rank % 10}"
    return {"pod": f"engine-{rank:04d}", "role": role, "rank": rank, "node": node,
            "version": version, "warm": True}  # fmt: skip


def status(members: int, version: int) -> dict[str, Any]:
    return {
        "members": [member(rank, version) for rank in range(members)],
        "currentVersion": version,
        "memberCount": members,
        "groupGeneration": 3,
    }


def crd(members_as_map: bool) -> str:
    document = yaml.safe_load(CRD_FILE.read_text())
    schema = document["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    members = schema["properties"]["status"]["properties"]["members"]
    if members_as_map:
        members["x-kubernetes-list-type"] = "map"
        members["x-kubernetes-list-map-keys"] = ["rank"]
    return yaml.safe_dump(document)


def parse_seconds(obj: dict[str, Any], repeat: int = 20) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        parse_weightsync({k: v for k, v in obj.items() if k != "status"})
    return (time.perf_counter() - started) / repeat


def measure(cluster: LocalCluster, workdir: Path, *, members_as_map: bool, args: Any) -> float:
    name = "map" if members_as_map else "atomic"
    path = workdir / f"crd-{name}.yaml"
    path.write_text(crd(members_as_map))
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    cluster.kubectl("wait", "--for=condition=Established", "crd/weightsyncs.weightsync.io")
    api = config.new_client_from_config(str(cluster.kubeconfig))
    custom = client.CustomObjectsApi(api)
    body = weightsync("s").namespace(NAMESPACE).build()
    for _ in range(30):  # the new schema is served a moment after Established
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
            break
        except client.ApiException:
            time.sleep(1)
    else:
        raise RuntimeError(f"the WeightSync was not accepted with members as {name}")
    writer = ApiWriter(config.new_client_from_config(str(cluster.kubeconfig)))

    async def patches() -> list[float]:
        seconds = []
        try:
            for version in range(1, args.patches + 1):
                started = time.perf_counter()
                await writer.patch_status(NAMESPACE, "s", status(args.members, version))
                seconds.append(time.perf_counter() - started)
        finally:
            await writer.close()
        return seconds[WARM_UP:]

    seconds = asyncio.run(patches())
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "s")
    managed = len(json.dumps(obj["metadata"].get("managedFields")))
    p50 = statistics.median(seconds)
    print(
        f"members as {name}: status patch p50 {p50 * 1000:.0f} ms, max"
        f" {max(seconds) * 1000:.0f} ms ({len(seconds)} patches); managedFields {managed} B;"
        f" parsing the WeightSync {parse_seconds(obj) * 1000:.1f} ms, without its"
        f" managedFields {parse_seconds(without_status(obj)) * 1000:.2f} ms",
        flush=True,
    )
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "s")
    cluster.kubectl("delete", "crd", "weightsyncs.weightsync.io")
    return p50


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="weightsync-status-patch-") as tmp:
        workdir = Path(tmp)
        cluster = LocalCluster(state_dir=workdir / "cluster", bin_dir=build_binaries(), nodes=0)
        cluster.up()
        try:
            cluster.kubectl("create", "namespace", NAMESPACE)
            ratios = []
            for _ in range(args.repeat):
                shipped = measure(cluster, workdir, members_as_map=False, args=args)
                as_map = measure(cluster, workdir, members_as_map=True, args=args)
                ratios.append(as_map / shipped)
            print("members as a map / atomic (status patch p50): "
                  + ", ".join(f"{r:.2f}x" for r in ratios))  # fmt: skip
        finally:
            cluster.down()
