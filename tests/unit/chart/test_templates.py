"""What the chart renders for each toggle, and the secure defaults of what it runs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.chart.helm import (
    CHART,
    MONITORING_API,
    NAMESPACE,
    find,
    is_hook,
    is_test,
    kinds,
    one,
    render,
    render_error,
)

MONITORS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
WITH_MONITORING = (MONITORING_API,)


def operator_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = operator_deployment(objects)["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return dict(containers[0])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


CLUSTER_SCOPED = {
    "ClusterRole", "ClusterRoleBinding",
    "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
}  # fmt: skip


def test_defaults_render_the_operator_and_nothing_optional() -> None:
    objects = render()
    assert kinds(objects) == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "Service", "Deployment", "ConfigMap", "Pod", "Job", "PodDisruptionBudget",
        "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
    }  # fmt: skip
    assert not kinds(objects) & {"Certificate", "Issuer", "NetworkPolicy", *MONITORS}
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]


def test_two_replicas_roll_without_losing_the_webhook_and_elect_a_leader() -> None:
    objects = render()
    spec = operator_deployment(objects)["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    container = operator_container(objects)
    assert container["command"] == ["weightsync-operator"]
    env = env_of(operator_container(objects))
    assert env["WEIGHTSYNC_OPERATOR_LEADER_LEASE"] == "ws-weightsync-leader"
    identity = next(e for e in container["env"] if e["name"] == "WEIGHTSYNC_OPERATOR_IDENTITY")
    assert identity["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # Ready once the webhook listens (a standby serves it too); liveness is kopf's.
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    assert "startupProbe" not in container
    probe = container["livenessProbe"]["httpGet"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert probe == {"path": "/healthz", "port": "health"}
    assert ports["health"] == 8080


def test_replicas_spread_over_nodes_and_a_drain_takes_one_at_a_time() -> None:
    objects = render()
    pod = operator_deployment(objects)["spec"]["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    selector = operator_deployment(objects)["spec"]["selector"]["matchLabels"]
    assert term["labelSelector"]["matchLabels"] == selector
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti  # preferred only
    budget = one(objects, "PodDisruptionBudget")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}


def test_one_replica_has_no_disruption_budget_to_block_drains() -> None:
    objects = render({"operator.replicas": "1"})
    assert operator_deployment(objects)["spec"]["replicas"] == 1
    assert not find(objects, "PodDisruptionBudget")


def test_url_mode_names_one_pod_so_it_refuses_replicas() -> None:
    url = {"webhook.url": '"https://$(POD_IP):9443"'}
    assert "webhook.url names one pod" in render_error(url)
    assert operator_deployment(render({**url, "operator.replicas": "1"}))["spec"]["replicas"] == 1


def test_leader_election_may_touch_its_own_lease_only() -> None:
    objects = render()
    role = one(objects, "Role", "ws-weightsync-leader-election")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        # create cannot be limited to a name; the Role limits it to this namespace
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["ws-weightsync-leader"],
            "verbs": ["get", "update"],
        },
    ]
    binding = one(objects, "RoleBinding", "ws-weightsync-leader-election")
    assert binding["roleRef"]["name"] == "ws-weightsync-leader-election"
    # Leases appear in no other rule: not cluster-wide, not in the workload namespaces.
    others = [
        rule
        for rule in _rules(objects)
        if "leases" in rule["resources"] and rule not in role["rules"]
    ]
    assert others == []


def test_operator_pod_has_secure_defaults() -> None:
    objects = render()
    pod = operator_deployment(objects)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(objects)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert "memory" in container["resources"]["limits"]
    # A read-only root still needs a scratch /tmp: the managed webhook key is written there.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]]["emptyDir"]["medium"] == "Memory"


def test_the_helm_test_pod_is_as_locked_down_as_the_operator() -> None:
    pod = one(render(), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = pod["spec"]["containers"][0]["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}


def test_pod_annotations_and_labels_reach_every_pod_but_no_selector() -> None:
    values = {
        "podAnnotations": json.dumps({"example.com/team": "rl"}),
        "podLabels": json.dumps({"team": "rl"}),
    }
    objects = render(values)
    deployment = operator_deployment(objects)
    template = deployment["spec"]["template"]["metadata"]
    test_pod = one(objects, "Pod")["metadata"]
    for meta in (template, test_pod):
        assert meta["annotations"]["example.com/team"] == "rl"
        assert meta["labels"]["team"] == "rl"
    assert "team" not in deployment["spec"]["selector"]["matchLabels"]
    for service in find(objects, "Service"):
        assert "team" not in service["spec"]["selector"]


def test_operator_and_agent_images_default_to_app_version_and_accept_digests() -> None:
    digest = "sha256:" + "ab" * 32
    container = operator_container(render())
    assert container["image"] == "weightsync/operator:0.1.0"
    assert env_of(container)["WEIGHTSYNC_OPERATOR_AGENT_IMAGE"] == "weightsync/agent:0.1.0"
    pinned = operator_container(
        render({"image.digest": json.dumps(digest), "agent.image.digest": json.dumps(digest)})
    )
    assert pinned["image"] == f"weightsync/operator@{digest}"
    assert env_of(pinned)["WEIGHTSYNC_OPERATOR_AGENT_IMAGE"] == f"weightsync/agent@{digest}"


# -- webhook certificates -------------------------------------------------------------


def test_operator_managed_certificates_by_default() -> None:
    objects = render()
    env = env_of(operator_container(objects))
    assert env["WEIGHTSYNC_OPERATOR_WEBHOOK_CERTS"] == "managed"
    secret = env["WEIGHTSYNC_OPERATOR_WEBHOOK_CERT_SECRET"]
    role = one(objects, "Role", "ws-weightsync-webhook-certs")
    named = [rule for rule in role["rules"] if rule.get("resourceNames")]
    assert named == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret],
         "verbs": ["get", "update"]}
    ]  # fmt: skip
    assert not find(objects, "Certificate")


def test_cert_manager_issues_a_certificate_for_the_webhook_service_and_mounts_it() -> None:
    objects = render({"certManager.enabled": "true"})
    certificate = one(objects, "Certificate")
    issuer = one(objects, "Issuer")
    assert issuer["spec"] == {"selfSigned": {}}
    assert certificate["spec"]["issuerRef"] == {
        "name": issuer["metadata"]["name"], "kind": "Issuer", "group": "cert-manager.io",
    }  # fmt: skip
    webhook = one(objects, "Service", "ws-weightsync-webhook")
    assert f"ws-weightsync-webhook.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    assert webhook["metadata"]["name"] == "ws-weightsync-webhook"

    container = operator_container(objects)
    env = env_of(container)
    assert env["WEIGHTSYNC_OPERATOR_WEBHOOK_CERTS"] == "directory"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = operator_deployment(objects)["spec"]["template"]["spec"]["volumes"]
    secret_volume = next(v for v in volumes if "secret" in v)
    assert secret_volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    assert mounts[secret_volume["name"]] == env["WEIGHTSYNC_OPERATOR_WEBHOOK_CERT_DIR"]
    # The operator keeps no certificate Secret of its own; only the token key (and its Lease).
    roles = sorted(r["metadata"]["name"] for r in find(objects, "Role") if not is_test(r))
    assert roles == [
        "ws-weightsync-leader-election", "ws-weightsync-token-key", "ws-weightsync-uninstall",
    ]  # fmt: skip


def test_the_operator_reads_no_secret_but_its_token_key_and_certificates() -> None:
    objects = render({})
    env = env_of(operator_container(objects))
    readable = [
        (kind, tuple(rule.get("resourceNames") or ["*"]))
        for kind in ("ClusterRole", "Role")
        for role in find(objects, kind)
        for rule in role["rules"]
        if "secrets" in rule["resources"] and {"get", "list", "watch"} & set(rule["verbs"])
    ]
    assert sorted(readable) == sorted(
        [
            ("Role", (env["WEIGHTSYNC_OPERATOR_WEBHOOK_CERT_SECRET"],)),
            ("Role", (env["WEIGHTSYNC_OPERATOR_TOKEN_KEY_SECRET"],)),
        ]
    )


def test_cert_manager_uses_a_given_issuer_instead_of_its_own() -> None:
    ref = {"name": "corp-ca", "kind": "ClusterIssuer"}
    objects = render({"certManager.enabled": "true", "certManager.issuerRef": json.dumps(ref)})
    assert not find(objects, "Issuer")
    assert one(objects, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io",
    }  # fmt: skip


def test_url_mode_has_no_webhook_service() -> None:
    objects = render({"webhook.url": '"https://$(POD_IP):9443"', "operator.replicas": "1"})
    assert [s["metadata"]["name"] for s in find(objects, "Service")] == ["ws-weightsync-metrics"]
    env = env_of(operator_container(objects))
    assert env["WEIGHTSYNC_OPERATOR_WEBHOOK_URL"] == "https://$(POD_IP):9443"
    assert "WEIGHTSYNC_OPERATOR_WEBHOOK_SERVICE_NAME" not in env


# -- monitoring -----------------------------------------------------------------------


def test_monitors_need_the_prometheus_operator_api() -> None:
    assert not kinds(render()) & MONITORS
    assert kinds(render(api_versions=WITH_MONITORING)) >= MONITORS


def test_monitors_render_without_cluster_access_when_told_the_api_is_present() -> None:
    # `helm template` for GitOps cannot ask the cluster: `present` renders them anyway,
    # `absent` never, whatever the cluster serves.
    assert kinds(render({"metrics.monitoringAPI": '"present"'})) >= MONITORS
    assert not kinds(render({"metrics.monitoringAPI": '"absent"'}, WITH_MONITORING)) & MONITORS


@pytest.mark.parametrize(
    ("toggle", "kind"),
    [
        ("metrics.serviceMonitor.enabled", "ServiceMonitor"),
        ("metrics.podMonitor.enabled", "PodMonitor"),
        ("prometheusRule.enabled", "PrometheusRule"),
    ],
)
def test_each_monitor_can_be_turned_off(toggle: str, kind: str) -> None:
    objects = render({toggle: "false"}, api_versions=WITH_MONITORING)
    assert kind not in kinds(objects)
    assert kinds(objects) & MONITORS == MONITORS - {kind}


def test_service_monitor_selects_the_metrics_service_only() -> None:
    objects = render(api_versions=WITH_MONITORING)
    monitor = one(objects, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        s for s in find(objects, "Service") if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["ws-weightsync-metrics"]
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert endpoint["honorLabels"] is True  # keeps per-WeightSync `namespace` labels
    target = selected[0]["spec"]["ports"][0]["targetPort"]
    assert target in {p["name"] for p in operator_container(objects)["ports"]}


def test_monitor_selector_labels_come_from_values() -> None:
    labels = json.dumps({"release": "kube-prometheus-stack"})
    objects = render(
        {
            "metrics.serviceMonitor.labels": labels,
            "metrics.podMonitor.labels": labels,
            "prometheusRule.labels": labels,
        },
        api_versions=WITH_MONITORING,
    )
    for kind in MONITORS:
        assert one(objects, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# -- dashboards -----------------------------------------------------------------------


def test_dashboards_configmap_carries_every_dashboard_file_for_grafana() -> None:
    objects = render()
    configmap = one(objects, "ConfigMap", "ws-weightsync-dashboards")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert files
    assert sorted(configmap["data"]) == [path.name for path in files]
    for path in files:
        assert json.loads(configmap["data"][path.name]) == json.loads(path.read_text())


def test_dashboards_can_go_elsewhere_or_be_left_out() -> None:
    elsewhere = render({"dashboards.namespace": '"monitoring"'})
    assert one(elsewhere, "ConfigMap", "ws-weightsync-dashboards")["metadata"]["namespace"] == (
        "monitoring"
    )
    assert not find(
        render({"dashboards.enabled": "false"}), "ConfigMap", "ws-weightsync-dashboards"
    )


# -- network policy -------------------------------------------------------------------


def test_network_policy_is_optional_and_allows_what_the_operator_needs() -> None:
    assert not find(render(), "NetworkPolicy")
    objects = render({"networkPolicy.enabled": "true", "agent.httpPort": "8471"})
    policy = one(objects, "NetworkPolicy")["spec"]
    deployment = operator_deployment(objects)
    assert policy["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    named_ports = {p["name"] for p in operator_container(objects)["ports"]}
    ingress_ports = {port["port"] for rule in policy["ingress"] for port in rule["ports"]}
    assert ingress_ports == {"webhook", "metrics"} <= named_ports
    egress_ports = {port["port"] for rule in policy["egress"] for port in rule["ports"]}
    assert egress_ports == {443, 6443, 8471, 53}


def test_network_policy_restricts_scrapers_when_asked() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    objects = render(
        {"networkPolicy.enabled": "true", "networkPolicy.metricsFrom": json.dumps(peers)}
    )
    rules = one(objects, "NetworkPolicy")["spec"]["ingress"]
    metrics_rule = next(r for r in rules if r["ports"][0]["port"] == "metrics")
    webhook_rule = next(r for r in rules if r["ports"][0]["port"] == "webhook")
    assert metrics_rule["from"] == peers
    assert "from" not in webhook_rule  # the API server is not a pod


# -- RBAC -----------------------------------------------------------------------------


def _rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        rule
        for obj in objects
        if obj["kind"] in ("ClusterRole", "Role") and not is_hook(obj) and not is_test(obj)
        for rule in obj["rules"]
    ]


def test_rbac_has_no_wildcards_and_cannot_enumerate_secrets() -> None:
    rules = _rules(render())
    assert rules
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        if "secrets" in rule["resources"]:
            assert not {"list", "watch"} & set(rule["verbs"])


def test_rbac_covers_what_the_operator_does() -> None:
    granted = {
        (group, resource, verb)
        for rule in _rules(render())
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {
        ("weightsync.io", "weightsyncs", "watch"),
        ("weightsync.io", "weightsyncs", "patch"),
        ("weightsync.io", "weightsyncs/status", "patch"),
        ("weightsync.io", "weightsyncs/finalizers", "update"),
        ("", "pods", "watch"),
        ("", "pods", "delete"),
        ("", "pods/status", "patch"),
        ("apps", "statefulsets", "get"),
        ("apps", "deployments", "get"),
        ("apps", "replicasets", "list"),
        ("batch", "jobs", "watch"),
        ("jobset.x-k8s.io", "jobsets", "watch"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets", "watch"),
        ("", "secrets", "create"),
        ("", "secrets", "get"),
        ("", "events", "create"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch"),
        ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "patch"),
    }
    assert needed <= granted, sorted(needed - granted)


def test_rbac_is_cluster_wide_by_default_and_per_namespace_when_scoped() -> None:
    cluster = render()
    bindings = {b["roleRef"]["name"] for b in find(cluster, "ClusterRoleBinding")}
    assert "ws-weightsync-workloads" in bindings

    scoped = render({"operator.watchNamespaces": '["team-a", "team-b"]'})
    bindings = {b["roleRef"]["name"] for b in find(scoped, "ClusterRoleBinding")}
    assert "ws-weightsync-workloads" not in bindings
    workload_bindings = [
        b for b in find(scoped, "RoleBinding") if b["roleRef"]["name"] == "ws-weightsync-workloads"
    ]
    assert sorted(b["metadata"]["namespace"] for b in workload_bindings) == ["team-a", "team-b"]
    cluster_rules = one(scoped, "ClusterRole", "ws-weightsync")["rules"]
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]} in (
        cluster_rules
    )
    env = env_of(operator_container(scoped))
    assert env["WEIGHTSYNC_OPERATOR_WATCH_NAMESPACES"] == "team-a,team-b"


def test_webhook_configuration_rights_are_limited_to_the_operators_own() -> None:
    objects = render()
    name = env_of(operator_container(objects))["WEIGHTSYNC_OPERATOR_WEBHOOK_CONFIGURATION"]
    rules = one(objects, "ClusterRole", "ws-weightsync")["rules"]
    webhook_rules = [r for r in rules if r["apiGroups"] == ["admissionregistration.k8s.io"]]
    assert {tuple(r["verbs"]): r.get("resourceNames") for r in webhook_rules} == {
        ("patch", "delete"): [name],  # no create: it cannot be limited to a name; no get: unread
    }
    # The chart creates both configurations, with no webhooks for upgrades to reset.
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        configuration = one(objects, kind, name)
        assert "webhooks" not in configuration
    # The helm test reads exactly those, and nothing else.
    test_role = next(r for r in find(objects, "ClusterRole") if is_test(r))
    assert test_role["rules"] == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["mutatingwebhookconfigurations", "validatingwebhookconfigurations"],
            "resourceNames": [name],
            "verbs": ["get"],
        }
    ]
    assert name in one(objects, "Pod")["spec"]["containers"][0]["command"]


def test_uninstall_runs_first_as_the_operator_and_removes_its_webhooks() -> None:
    objects = render({"operator.watchNamespaces": '["team-a"]'})
    job = one(objects, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    deployment = operator_deployment(objects)
    assert pod["serviceAccountName"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]
    name = env_of(operator_container(objects))["WEIGHTSYNC_OPERATOR_WEBHOOK_CONFIGURATION"]
    assert pod["containers"][0]["command"] == [
        "weightsync-uninstall",
        f"--operator-namespace={NAMESPACE}",
        f"--deployment={deployment['metadata']['name']}",
        f"--webhook-configuration={name}",
        "--test-pod=ws-weightsync-test-webhooks",
        # Until the operator pod's grace period has run out, dropped finalizers are
        # dropped again (a terminating pod may add one back).
        f"--operator-grace-seconds={deployment['spec']['template']['spec']['terminationGracePeriodSeconds']}",
        "--namespace=team-a",
    ]


def test_rbac_and_service_account_can_be_brought_by_the_user() -> None:
    objects = render(
        {"rbac.create": "false", "serviceAccount.create": "false", "serviceAccount.name": '"ops"'}
    )
    operator_objects = [o for o in objects if not is_hook(o) and not is_test(o)]
    rbac = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    assert not kinds(operator_objects) & rbac
    assert not find(operator_objects, "ServiceAccount")
    assert operator_deployment(objects)["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_the_helm_test_script_is_the_charts_file() -> None:
    objects = render()
    configmap = next(c for c in find(objects, "ConfigMap") if is_test(c))
    script = (CHART / "files" / "check_webhooks.py").read_text()
    assert configmap["data"]["check_webhooks.py"] == script.rstrip("\n")
    assert not find(render({"tests.enabled": "false"}), "Pod")


def test_scheduling_and_pull_secrets_reach_the_operator_pod() -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["ops"]}]}
                ]
            }
        }
    }
    objects = render(
        {
            "imagePullSecrets": '["registry-creds"]',
            "nodeSelector": '{"pool": "ops"}',
            "tolerations": json.dumps([toleration]),
            "affinity": json.dumps(affinity),
            "priorityClassName": '"system-cluster-critical"',
        }
    )
    pod = operator_deployment(objects)["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["nodeSelector"] == {"pool": "ops"}
    assert pod["tolerations"] == [toleration]
    assert pod["affinity"] == affinity
    assert pod["priorityClassName"] == "system-cluster-critical"
    test_pod = one(objects, "Pod")["spec"]
    assert test_pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert test_pod["tolerations"] == [toleration]


def test_the_helm_test_reads_only_the_webhook_service_in_its_namespace() -> None:
    objects = render()
    role = next(r for r in find(objects, "Role") if is_test(r))
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["services"],
         "resourceNames": ["ws-weightsync-webhook"], "verbs": ["get"]},
    ]  # fmt: skip
    binding = next(b for b in find(objects, "RoleBinding") if is_test(b))
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == one(objects, "Pod")["spec"]["serviceAccountName"]
