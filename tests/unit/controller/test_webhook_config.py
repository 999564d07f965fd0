"""The webhook entries the operator patches into its configurations (by name only)."""

from __future__ import annotations

from weightsync.controller import names
from weightsync.controller.admission.webhook_config import INJECT_AGENT, VALIDATE_CLAIMS, entries

SERVICE = {
    "service": {"name": "ws-webhook", "namespace": "ops", "port": 443, "path": ""},
    "caBundle": "Q0E=",
}


def test_each_webhook_is_served_at_its_handler_id_with_its_policy() -> None:
    built = entries(SERVICE, "ws.weightsync.io")
    (inject,) = built["mutating"]
    (claims,) = built["validating"]
    assert inject["name"] == "inject-agent.ws.weightsync.io"
    assert inject["clientConfig"] == {
        "service": {"name": "ws-webhook", "namespace": "ops", "port": 443, "path": "/inject-agent"},
        "caBundle": "Q0E=",
    }
    # A failed injection must not block pod creation; a failed claim check blocks the write.
    assert (inject["failurePolicy"], claims["failurePolicy"]) == ("Ignore", "Fail")
    assert inject["rules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
         "operations": ["CREATE"], "scope": "*"},
    ]  # fmt: skip
    assert inject["objectSelector"] == {
        "matchExpressions": [
            {"key": names.INJECT_LABEL, "operator": "In", "values": [names.INJECT_VALUE]}
        ]
    }
    assert "objectSelector" not in claims
    assert claims["rules"][0]["operations"] == list(VALIDATE_CLAIMS.operations)
    assert SERVICE["service"]["path"] == ""  # the caller's config is not changed


def test_url_mode_appends_the_id_and_exit_removes_every_webhook() -> None:
    built = entries({"url": "https://127.0.0.1:9443/"}, "x.weightsync.io")
    assert built["mutating"][0]["clientConfig"] == {
        "url": f"https://127.0.0.1:9443/{INJECT_AGENT.id}"
    }
    assert entries(None, "x.weightsync.io") == {"mutating": [], "validating": []}
