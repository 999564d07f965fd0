"""The chart against the operator's code: its settings, its API calls, its injected sidecar.

* The rendered env is resolved the way the kubelet would (downward API, `$(VAR)`
  expansion) and handed to `OperatorSettings.from_env`, which refuses unknown
  `WEIGHTSYNC_OPERATOR_*` variables: a chart that drifts from the operator fails here.
* Every Kubernetes client method the controller's modules name must be granted by RBAC.
* The PodMonitor scrapes the port and label that the webhook's sidecar really has.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import pytest

from tests.unit.chart.helm import (
    MONITORING_API,
    NAMESPACE,
    ROOT,
    find,
    is_hook,
    is_test,
    one,
    render,
)
from weightsync.controller.settings import CertMode, OperatorSettings, PullPolicy

POD_IP = "10.1.2.3"
POD_NAME = "ws-weightsync-6d5f-abcde"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def resolved_env(container: dict[str, Any], pod_namespace: str = NAMESPACE) -> dict[str, str]:
    """The container's environment as the kubelet would set it."""
    fields = {
        "metadata.namespace": pod_namespace,
        "metadata.name": POD_NAME,
        "status.podIP": POD_IP,
    }
    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = _VAR.sub(lambda m: env.get(m[1], m[0]), item["value"])
    return env


def settings_from_chart(objects: list[dict[str, Any]]) -> OperatorSettings:
    deployment = one(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return OperatorSettings.from_env(resolved_env(container))


def container_ports(objects: list[dict[str, Any]]) -> dict[str, int]:
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def test_defaults_are_a_valid_service_mode_configuration() -> None:
    objects = render()
    settings = settings_from_chart(objects)
    service = one(objects, "Service", "ws-weightsync-webhook")
    assert settings.namespace == NAMESPACE
    assert settings.webhook_url is None
    assert settings.webhook_service_name == service["metadata"]["name"]
    assert settings.service_namespace == service["metadata"]["namespace"]
    assert settings.webhook_service_port == service["spec"]["ports"][0]["port"] == 443
    assert service["spec"]["ports"][0]["targetPort"] == "webhook"
    ports = container_ports(objects)
    assert settings.webhook_listen_port == ports["webhook"]
    assert settings.metrics_port == ports["metrics"]
    assert settings.health_port == ports["health"]
    assert settings.watch_namespaces == ()
    assert settings.webhook_certs is CertMode.MANAGED
    assert settings.webhook_configuration == "ws-weightsync.weightsync.io"


def test_agent_defaults_match_the_agents_own() -> None:
    from weightsync.agent.settings import AgentSettings

    settings = settings_from_chart(render())
    agent_fields = AgentSettings.model_fields
    assert settings.agent_http_port == agent_fields["http_port"].default
    assert settings.agent_metrics_port == agent_fields["metrics_port"].default
    assert settings.agent_image == "weightsync/agent:0.1.0"
    assert settings.agent_image_pull_policy is PullPolicy.IF_NOT_PRESENT
    assert (settings.agent_cpu_request, settings.agent_memory_request) == ("500m", "1Gi")
    assert (settings.agent_cpu_limit, settings.agent_memory_limit) == ("", "")


def test_values_reach_the_operator() -> None:
    settings = settings_from_chart(
        render(
            {
                "operator.logLevel": '"DEBUG"',
                "operator.resyncSeconds": "2.5",
                "operator.agentTimeoutSeconds": "3",
                "operator.metricsPort": "9191",
                "agent.httpPort": "18470",
                "agent.metricsPort": "19470",
                "agent.rendezvousPort": "29999",
                "agent.logLevel": '"WARNING"',
                "agent.image.pullPolicy": '"Always"',
                "agent.resources.limits.memory": '"64Gi"',
                "webhook.port": "10443",
                "webhook.servicePort": "8443",
                "webhook.configurationName": '"weightsync.example.org"',
            }
        )
    )
    assert settings.log_level == "DEBUG"
    assert (settings.resync_seconds, settings.agent_timeout_seconds) == (2.5, 3.0)
    assert settings.metrics_port == 9191
    assert (settings.agent_http_port, settings.agent_metrics_port) == (18470, 19470)
    assert settings.rendezvous_port == 29999
    assert settings.agent_log_level == "WARNING"
    assert settings.token_key_secret == "ws-weightsync-token-key"
    assert settings.agent_image_pull_policy is PullPolicy.ALWAYS
    assert settings.agent_memory_limit == "64Gi"
    assert (settings.webhook_listen_port, settings.webhook_service_port) == (10443, 8443)
    assert settings.webhook_configuration == "weightsync.example.org"


def test_url_mode_on_the_pod_ip_for_local_control_planes() -> None:
    objects = render(
        {
            "webhook.url": '"https://$(POD_IP):9443"',
            "webhook.listenHost": '"$(POD_IP)"',
            "operator.replicas": "1",
        }
    )
    settings = settings_from_chart(objects)
    assert settings.webhook_url == f"https://{POD_IP}:9443"
    assert settings.webhook_listen_host == POD_IP
    assert settings.webhook_host == POD_IP
    assert settings.webhook_service_name is None


def test_cert_manager_mode_reads_the_mounted_secret() -> None:
    objects = render({"certManager.enabled": "true"})
    settings = settings_from_chart(objects)
    assert settings.webhook_certs is CertMode.DIRECTORY
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
    assert str(settings.webhook_cert_dir) in mounts
    certificate = one(objects, "Certificate")
    assert settings.webhook_host in certificate["spec"]["dnsNames"]


def test_watch_namespaces_reach_the_operator() -> None:
    settings = settings_from_chart(render({"operator.watchNamespaces": '["team-a", "team-b"]'}))
    assert settings.watch_namespaces == ("team-a", "team-b")


def test_every_operator_setting_is_wired_by_some_configuration_of_the_chart() -> None:
    """A setting the operator gains must get a value in the chart (or this test a reason)."""
    configurations = [
        {},
        {"webhook.url": '"https://$(POD_IP):9443"', "operator.replicas": "1"},
        {"certManager.enabled": "true"},
        {"operator.watchNamespaces": '["team-a"]'},
    ]
    wired: set[str] = set()
    for values in configurations:
        container = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        wired |= {
            name.removeprefix("WEIGHTSYNC_OPERATOR_").lower()
            for name in resolved_env(container)
            if name.startswith("WEIGHTSYNC_OPERATOR_")
        }
    assert wired == set(OperatorSettings.model_fields)


def test_extra_env_is_appended_and_still_checked_by_the_operator() -> None:
    from weightsync.controller.settings import SettingsError

    extra = '[{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]'
    objects = render({"operator.extraEnv": extra})
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["env"][-1] == {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}
    settings_from_chart(objects)

    typo = '[{"name": "WEIGHTSYNC_OPERATOR_RESYNC_SECOND", "value": "1"}]'
    with pytest.raises(SettingsError, match="RESYNC_SECOND is not a weightsync operator setting"):
        settings_from_chart(render({"operator.extraEnv": typo}))
    assert find(objects, "Deployment")


def test_pod_monitor_scrapes_the_port_and_label_the_webhook_injects() -> None:
    from weightsync.api.control import Role
    from weightsync.api.v1alpha1 import WeightSync
    from weightsync.controller import names
    from weightsync.controller.admission.sidecar import agent_container
    from weightsync.controller.main import agent_template

    objects = render(api_versions=(MONITORING_API,))
    monitor = one(objects, "PodMonitor")["spec"]
    settings: OperatorSettings = settings_from_chart(objects)
    sync = WeightSync.model_validate(
        {
            "apiVersion": "weightsync.io/v1alpha1",
            "kind": "WeightSync",
            "metadata": {"name": "tiny", "namespace": "rl"},
            "spec": {
                "trainer": {"statefulSetRef": {"name": "trainer"}},
                "inference": [
                    {"deploymentRef": {"name": "engine"}, "engine": "Reference", "port": 8000}
                ],
            },
        }
    )
    from weightsync.controller.membership.trainer_ranks import ServedRanks

    template = agent_template(settings)
    sink = agent_container(sync, Role.SINK, 0, "cpu", template)
    trainer = agent_container(
        sync, Role.SOURCE, None, "cuda:0", template, served=ServedRanks(2, (0, 1))
    )
    endpoint = monitor["podMetricsEndpoints"][0]
    assert "port" not in endpoint  # every port is a target; the relabeling keeps ours
    keep, label = endpoint["relabelings"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    assert keep["action"] == "keep"
    pattern = re.compile(keep["regex"])
    scraped = {
        p["containerPort"]
        for container in (sink, trainer)
        for p in container["ports"]
        if pattern.fullmatch(p["name"])
    }
    assert scraped == {9470, 9471}  # every metrics port, no control port
    assert monitor["selector"]["matchExpressions"] == [
        {"key": names.SYNC_LABEL, "operator": "Exists"}
    ]
    sanitized = names.SYNC_LABEL.replace(".", "_").replace("/", "_")
    assert label == {
        "sourceLabels": [f"__meta_kubernetes_pod_label_{sanitized}"],
        "targetLabel": "weightsync",
    }
    assert monitor["namespaceSelector"] == {"any": True}


# Kubernetes client methods: <verb>_namespaced_<kind>[_status], or <verb>_<kind> for the
# cluster-scoped kinds below.
_CLIENT_METHOD = re.compile(
    r"^(?P<verb>get|read|list|create|patch|replace|delete)_(?P<namespaced>namespaced_)?"
    r"(?P<kind>[a-z_]+?)(?P<sub>_status|_scale)?$"
)
_VERBS = {"get": "get", "read": "get", "list": "list", "create": "create", "patch": "patch",
          "replace": "update", "delete": "delete"}  # fmt: skip
_GROUPS = {
    "pods": "", "secrets": "", "events": "", "configmaps": "", "namespaces": "",
    "statefulsets": "apps", "deployments": "apps", "replicasets": "apps", "jobs": "batch",
    "weightsyncs": "weightsync.io",
    "mutatingwebhookconfigurations": "admissionregistration.k8s.io",
    "validatingwebhookconfigurations": "admissionregistration.k8s.io",
    "customresourcedefinitions": "apiextensions.k8s.io",
    "leases": "coordination.k8s.io",
}  # fmt: skip
_CLUSTER_KINDS = {
    "namespace", "mutating_webhook_configuration", "validating_webhook_configuration",
    "custom_resource_definition", "cluster_custom_object",
}  # fmt: skip


def api_calls_in_controller() -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every client method named in weightsync.controller, and
    of the requests a module sends past the client (its `API_CALLS`)."""
    calls = set()
    for path in sorted((ROOT / "operator" / "weightsync" / "controller").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "API_CALLS" for t in node.targets
            ):
                calls.update(ast.literal_eval(node.value))
            if not isinstance(node, ast.Attribute):
                continue
            match = _CLIENT_METHOD.match(node.attr)
            if match is None:
                continue
            kind = match["kind"]
            if not match["namespaced"] and kind not in _CLUSTER_KINDS:
                continue  # a method of our own (get_weightsync), not the client's
            resource = (
                "weightsyncs" if kind.endswith("custom_object") else kind.replace("_", "") + "s"
            )
            if match["sub"]:
                resource += "/" + match["sub"][1:]
            group = _GROUPS[resource.split("/")[0]]
            calls.add((group, resource, _VERBS[match["verb"]]))
    return calls


def test_rbac_grants_every_api_call_the_operator_makes() -> None:
    calls = api_calls_in_controller()
    assert ("", "pods/status", "patch") in calls  # the reader sees through the code
    granted = {
        (group, resource, verb)
        for obj in render()
        if obj["kind"] in ("ClusterRole", "Role") and not is_hook(obj) and not is_test(obj)
        for rule in obj["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert calls <= granted, f"RBAC lacks {sorted(calls - granted)}"


def test_service_links_cannot_smuggle_settings_into_the_operator() -> None:
    """A release named `weightsync-operator` has Services `weightsync-operator-*`; with
    service links the kubelet would set WEIGHTSYNC_OPERATOR_WEBHOOK_SERVICE_HOST & co,
    which OperatorSettings refuses, and the operator would never start."""
    from weightsync.controller.settings import SettingsError

    objects = render({"fullnameOverride": '"weightsync-operator"'})
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False
    links = {
        f"{s['metadata']['name'].upper().replace('-', '_')}_SERVICE_HOST": "10.0.0.1"
        for s in find(objects, "Service")
    }
    assert "WEIGHTSYNC_OPERATOR_WEBHOOK_SERVICE_HOST" in links
    env = {**resolved_env(pod["containers"][0]), **links}
    with pytest.raises(SettingsError, match="WEBHOOK_SERVICE_HOST is not a weightsync"):
        OperatorSettings.from_env(env)


def test_the_charts_agent_env_reaches_every_sidecar_and_never_replaces_the_operators() -> None:
    from weightsync.controller.main import agent_template
    from weightsync.controller.settings import SettingsError

    fabric = '[{"name": "NCCL_IB_HCA", "value": "mlx5_0"}, {"name": "NCCL_DEBUG"}]'
    settings = settings_from_chart(render({"agent.env": fabric}))
    assert agent_template(settings).env == (
        {"name": "NCCL_IB_HCA", "value": "mlx5_0"},
        {"name": "NCCL_DEBUG", "value": ""},
    )
    assert agent_template(settings_from_chart(render())).env == ()
    reserved = '[{"name": "WEIGHTSYNC_DEVICE", "value": "cuda:3"}]'
    with pytest.raises(SettingsError, match="operator's settings of the agent"):
        settings_from_chart(render({"agent.env": reserved}))
    from tests.unit.chart.helm import render_error

    assert "/agent/env/0/name" in render_error({"agent.env": '[{"name": "NCCL IB"}]'})
