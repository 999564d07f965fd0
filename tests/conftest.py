"""Fixtures shared by every tier. The control plane starts only for tests that ask for it."""

from __future__ import annotations

import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.controlplane import LocalCluster, NodeImages, build_binaries
from tests.cluster.node import host
from tests.support.eventually import Timeouts, eventually

CLUSTER_FIXTURES = {"cluster", "namespace", "k8s", "images"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A test that needs the API server is a cluster test, whether or not it says so.
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & CLUSTER_FIXTURES and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.cluster)
    # Tests with a node of their own run before the session cluster starts, so that they
    # and it take turns on one image store (`node_images`). The sort is stable.
    items.sort(key=lambda item: item.get_closest_marker("own_node") is None)


@pytest.fixture(scope="session")
def node_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeImages]:
    # Not created here: containerd makes its root, and a missing one tells the demo's
    # disk check that nothing is imported yet.
    shared = NodeImages(tmp_path_factory.getbasetemp() / "node-images")
    try:
        yield shared
    finally:  # gigabytes: not left for pytest's kept temp folders
        if shared.path.exists():
            host.unmount_under(shared.path)
            subprocess.run(["rm", "-rf", str(shared.path)], check=False)


@pytest.fixture(scope="session")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, node_images: NodeImages
) -> Iterator[LocalCluster]:
    """A fresh local control plane with one real node (kubelet, containerd: pods that run)
    and two KWOK nodes (`type=kwok`: pods that only need scheduling)."""
    state_dir: Path = tmp_path_factory.mktemp("cluster")
    with node_images.turn("the session cluster") as images_dir:
        local = LocalCluster(
            state_dir=state_dir,
            bin_dir=build_binaries(),
            nodes=2,
            real_node=True,
            images_dir=images_dir,
        )
        local.up()
        try:
            yield local
        finally:
            local.down()


@pytest.fixture(scope="session")
def images(cluster: LocalCluster) -> dict[str, str]:
    """weightsync's images (built by `.ci/setup`, cached) in the real node's containerd:
    name -> reference, for pods with `imagePullPolicy: Never`."""
    from tests.cluster.images import ensure_images

    built = ensure_images(cluster.node.containerd_address)
    return {name: info.ref for name, info in built.items()}


@pytest.fixture
def k8s(cluster: LocalCluster) -> Iterator[object]:
    """A kubernetes ApiClient authenticated as the cluster admin."""
    from kubernetes import config

    api = config.new_client_from_config(str(cluster.kubeconfig))
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own, deleted (and waited for) afterwards."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug}-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", name)
    # Pods are rejected until the namespace's default ServiceAccount exists.
    eventually(
        lambda: (
            cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
            == 0
        ),
        timeout=Timeouts.API,
        message=f"default ServiceAccount in {name}",
    )
    try:
        yield name
    finally:
        # Deletion is asynchronous (the namespace controller removes its objects and the
        # kubelet stops their containers); waiting for it would add seconds per test.
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
