"""The chart's RBAC, applied to a real API server and asked with `kubectl auth can-i`
as the operator's ServiceAccount: with `operator.watchNamespaces`, rights on pods,
pods/status and Secrets exist only in the watched namespaces, and no Secret can be read
anywhere (agent tokens are derived, never read back)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import yaml

from tests.cluster.controlplane import LocalCluster
from tests.unit.chart.helm import CHART, helm

pytestmark = pytest.mark.cluster

RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


@pytest.fixture
def scoped_release(cluster: LocalCluster, namespace: str) -> Iterator[tuple[str, str, str]]:
    """The chart's RBAC objects for a release in `namespace` watching one other namespace:
    (account, watched namespace, unwatched namespace)."""
    release = f"rbac{secrets.token_hex(3)}"
    watched, unwatched = f"{namespace}-watched", f"{namespace}-other"
    for name in (watched, unwatched):
        cluster.kubectl("create", "namespace", name)
    rendered = helm(
        "template", release, str(CHART), "--namespace", namespace,
        "--set-json", f'operator.watchNamespaces=["{watched}"]',
    ).stdout  # fmt: skip
    objects = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] in RBAC_KINDS]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    (account,) = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"
                  and "test" not in o["metadata"]["name"]]  # fmt: skip
    try:
        yield f"system:serviceaccount:{namespace}:{account}", watched, unwatched
    finally:
        for obj in objects:
            if obj["kind"].startswith("Cluster"):
                cluster.kubectl("delete", obj["kind"], obj["metadata"]["name"], check=False)
        for name in (watched, unwatched):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_a_scoped_operator_has_pod_and_secret_rights_only_where_it_watches(
    cluster: LocalCluster, scoped_release: tuple[str, str, str]
) -> None:
    account, watched, unwatched = scoped_release

    def may(verb: str, resource: str, namespace: str) -> bool:
        kind, _, sub = resource.partition("/")  # `pods/status`: a subresource, asked as such
        answer = cluster.kubectl(
            "auth", "can-i", verb, kind, *([f"--subresource={sub}"] if sub else []),
            "-n", namespace, "--as", account, check=False,
        )  # fmt: skip
        return answer.stdout.strip() == "yes"

    # What it needs where it watches: list and gate pods, replace uninjected ones, write
    # the token Secrets it derives.
    for verb, resource in [
        ("list", "pods"), ("watch", "pods"), ("delete", "pods"), ("patch", "pods/status"),
        ("create", "secrets"), ("patch", "secrets"),
    ]:  # fmt: skip
        assert may(verb, resource, watched), (verb, resource, watched)
    # Nothing of the kind elsewhere, kube-system included.
    for namespace in (unwatched, "kube-system"):
        for verb, resource in [
            ("list", "pods"), ("delete", "pods"), ("patch", "pods/status"),
            ("create", "secrets"), ("patch", "secrets"),
        ]:  # fmt: skip
            assert not may(verb, resource, namespace), (verb, resource, namespace)
    # No Secret is readable, not even in the watched namespace.
    for namespace in (watched, unwatched, "kube-system"):
        for verb in ("get", "list", "watch"):
            assert not may(verb, "secrets", namespace), (verb, namespace)
