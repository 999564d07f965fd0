"""The chart's RBAC, applied to a real API server and asked with `kubectl auth can-i`
as the operator's ServiceAccount: with `operator.watchNamespaces`, rights on pods,
pods/status and Secrets exist only in the watched namespaces, and no Secret can be read
anywhere (agent tokens are derived, never read back): no verb it holds on Secrets answers
with another party's Secret, dry runs included."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.cluster.controlplane import LocalCluster
from tests.unit.chart.helm import CHART, helm

pytestmark = pytest.mark.cluster

RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


@pytest.fixture
def scoped_release(cluster: LocalCluster, namespace: str) -> Iterator[tuple[str, str, str, str]]:
    """The chart's RBAC objects for a release in `namespace` watching one other namespace:
    (account, watched namespace, unwatched namespace, its webhook configurations' name)."""
    release = f"rbac{secrets.token_hex(3)}"
    watched, unwatched = f"{namespace}-watched", f"{namespace}-other"
    for name in (watched, unwatched):
        cluster.kubectl("create", "namespace", name)
    rendered = helm(
        "template", release, str(CHART), "--namespace", namespace,
        "--set-json", f'operator.watchNamespaces=["{watched}"]',
    ).stdout  # fmt: skip
    everything = [o for o in yaml.safe_load_all(rendered) if o]
    objects = [o for o in everything if o["kind"] in RBAC_KINDS]
    (configuration,) = [
        o["metadata"]["name"] for o in everything if o["kind"] == "MutatingWebhookConfiguration"
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    (account,) = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"
                  and "test" not in o["metadata"]["name"]]  # fmt: skip
    try:
        yield f"system:serviceaccount:{namespace}:{account}", watched, unwatched, configuration
    finally:
        for obj in objects:
            if obj["kind"].startswith("Cluster"):
                cluster.kubectl("delete", obj["kind"], obj["metadata"]["name"], check=False)
        for name in (watched, unwatched):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_a_scoped_operator_has_pod_and_secret_rights_only_where_it_watches(
    cluster: LocalCluster, scoped_release: tuple[str, str, str, str]
) -> None:
    account, watched, unwatched, configuration = scoped_release

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
        ("create", "secrets"), ("update", "secrets"),
    ]:  # fmt: skip
        assert may(verb, resource, watched), (verb, resource, watched)
    # Nothing of the kind elsewhere, kube-system included.
    for namespace in (unwatched, "kube-system"):
        for verb, resource in [
            ("list", "pods"), ("delete", "pods"), ("patch", "pods/status"),
            ("create", "secrets"), ("update", "secrets"),
        ]:  # fmt: skip
            assert not may(verb, resource, namespace), (verb, resource, namespace)
    # No Secret is readable, not even in the watched namespace: no verb that answers with
    # one (a patch and a delete reply with the whole Secret).
    for namespace in (watched, unwatched, "kube-system"):
        for verb in ("get", "list", "watch", "patch", "delete"):
            assert not may(verb, "secrets", namespace), (verb, namespace)

    # Webhook configurations: its own two patched by name, none created or patched by
    # any other name (a webhook of its own making would see every object in the cluster).
    def may_cluster(verb: str, what: str) -> bool:
        answer = cluster.kubectl("auth", "can-i", verb, what, "--as", account, check=False)
        return answer.stdout.strip() == "yes"

    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        assert may_cluster("patch", f"{kind}/{configuration}"), (kind, configuration)
        assert not may_cluster("patch", f"{kind}/another.example.com"), kind
        assert not may_cluster("create", kind), kind


def test_no_secret_content_comes_back_to_the_operator(
    cluster: LocalCluster, scoped_release: tuple[str, str, str, str]
) -> None:
    """Another party's Secret in a watched namespace, asked for every way the operator's
    rights allow, dry runs included: its value never comes back."""
    account, watched, _, _ = scoped_release
    value = secrets.token_hex(16)
    cluster.kubectl(
        "create", "secret", "generic", "database", f"--from-literal=password={value}",
        "-n", watched,
    )  # fmt: skip
    encoded = base64.b64encode(value.encode()).decode()
    # Straight to the API (kubectl reads an object before it patches or deletes it).
    api = config.new_client_from_config(str(cluster.kubeconfig))
    api.set_default_header("Impersonate-User", account)
    core = client.CoreV1Api(api)
    ours = {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "database"},
        "type": "Opaque", "stringData": {"token": "ours"},
    }  # fmt: skip
    calls = {
        "get": lambda: core.read_namespaced_secret("database", watched, _preload_content=False),
        "patch": lambda: core.patch_namespaced_secret(
            "database", watched, {}, dry_run="All", _preload_content=False
        ),
        "delete": lambda: core.delete_namespaced_secret(
            "database", watched, dry_run="All", _preload_content=False
        ),
        "replace": lambda: core.replace_namespaced_secret(
            "database", watched, ours, dry_run="All", _preload_content=False
        ),
    }
    statuses = {}
    for verb, call in calls.items():
        try:
            response = call()
            statuses[verb], answer = response.status, response.data.decode()
        except ApiException as error:
            statuses[verb], answer = error.status, str(error.body)
        assert value not in answer, verb
        assert encoded not in answer, verb
    # Refused where the answer would be the Secret; the replace it may do (dry run)
    # answers with what it sent.
    assert statuses == {"get": 403, "patch": 403, "delete": 403, "replace": 200}
