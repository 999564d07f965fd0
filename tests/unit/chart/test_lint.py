"""`helm lint --strict`, and the schema refusing what a typo produces."""

from __future__ import annotations

import pytest

from tests.unit.chart.helm import CHART, helm, render_error

TOGGLES = {
    "defaults": [],
    "cert-manager": ["--set", "certManager.enabled=true"],
    "url mode": [
        "--set", "webhook.url=https://$(POD_IP):9443", "--set", "webhook.listenHost=$(POD_IP)",
        "--set", "operator.replicas=1",
    ],
    "namespaced": ["--set-json", 'operator.watchNamespaces=["team-a","team-b"]'],
    "network policy": ["--set", "networkPolicy.enabled=true"],
    "everything off": [
        "--set", "dashboards.enabled=false", "--set", "tests.enabled=false",
        "--set", "rbac.create=false", "--set", "serviceAccount.create=false",
    ],
}  # fmt: skip


@pytest.mark.parametrize("args", TOGGLES.values(), ids=TOGGLES.keys())
def test_helm_lint_strict_passes(args: list[str]) -> None:
    result = helm("lint", "--strict", str(CHART), *args)
    assert "0 chart(s) failed" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"imagee": '{"tag": "x"}'}, "additional properties 'imagee' not allowed"),
        ({"operator.logLevle": '"DEBUG"'}, "additional properties 'logLevle' not allowed"),
        ({"metrics.podMonitor.enable": "true"}, "additional properties 'enable' not allowed"),
        ({"webhook.port": '"9443"'}, "got string, want integer"),
        ({"certManager.enabled": '"yes"'}, "got string, want boolean"),
        ({"operator.watchNamespaces": '"team-a"'}, "got string, want array"),
        ({"image.pullPolicy": '"Sometimes"'}, "value must be one of 'Always', 'IfNotPresent'"),
        ({"prometheusRule.versionLag.for": '"ten minutes"'}, "does not match pattern"),
        ({"agent.image.digest": '"sha256:abc"'}, "does not match pattern"),
        ({"webhook.url": '"http://127.0.0.1:9443"'}, "does not match pattern"),
        # A quantity that only ends like one: the pattern is anchored at both ends.
        ({"agent.resources.requests.cpu": '"abc5"'}, "at '/agent/resources/requests/cpu'"),
    ],
)
def test_the_schema_refuses_typos_and_wrong_types(values: dict[str, str], message: str) -> None:
    assert message in render_error(values)
    args = [arg for key, value in values.items() for arg in ("--set-json", f"{key}={value}")]
    lint = helm("lint", "--strict", str(CHART), *args, check=False)
    assert lint.returncode != 0
    assert message in lint.stdout + lint.stderr


def test_cert_manager_with_url_mode_is_refused_with_a_reason() -> None:
    error = render_error({"certManager.enabled": "true", "webhook.url": '"https://10.0.0.1:9443"'})
    assert "certManager.enabled needs Service mode" in error
