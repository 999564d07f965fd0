"""The engine docs' examples are valid and name what the engine modules inject."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync.api import parse_weightsync
from weightsync.api.engines import EngineInjection
from weightsync.engines.sglang import SGLANG_INJECTION, SGLANG_VERSION
from weightsync.engines.vllm import VLLM_INJECTION, VLLM_VERSION

DOCS = Path(__file__).resolve().parents[3] / "docs" / "engines"

PAGES = [
    ("sglang.md", "SGLang", SGLANG_INJECTION, SGLANG_VERSION),
    ("vllm.md", "VLLM", VLLM_INJECTION, VLLM_VERSION),
]


def _manifests(text: str) -> list[dict[str, Any]]:
    """The page's whole objects (fragments of a spec, which have no kind, left out)."""
    return [
        doc
        for block in re.findall(r"```yaml\n(.*?)```", text, re.S)
        for doc in yaml.safe_load_all(block)
        if isinstance(doc, dict) and "kind" in doc
    ]


@pytest.mark.parametrize(("page", "engine", "injection", "version"), PAGES)
def test_engine_page_example_is_a_valid_weightsync_and_deployment(
    page: str, engine: str, injection: EngineInjection, version: str
) -> None:
    text = (DOCS / page).read_text()
    assert f"Checked against {engine.replace('VLLM', 'vLLM')} {version}" in text
    # Each page says which version CI runs on CPU and what it observed there.
    assert "## Versions run and targeted" in text
    assert "## Observed on the real server" in text
    manifests = {doc["kind"]: doc for doc in _manifests(text)}
    sync = parse_weightsync(manifests["WeightSync"])
    (entry,) = sync.spec.inference
    assert entry.engine == engine
    deployment = manifests["Deployment"]
    assert entry.deployment_ref.name == deployment["metadata"]["name"]
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["weightsync.io/inject"] == "true"
    (container,) = template["spec"]["containers"]
    # The engine on the pod's loopback, its clients and probes through the agent's front.
    assert entry.front is not None
    assert "--host=127.0.0.1" in container["args"]
    assert f"--port={entry.port}" in container["args"]
    assert container["readinessProbe"]["httpGet"]["port"] == entry.front.port
    # The example leaves the injected flags to the webhook.
    assert injection.merged_args(container["args"]) == [*container["args"], *injection.args]
    for flag in injection.flags:
        assert f"`{flag.name}" in text
    for name in injection.env:
        assert f"`{name}=1`" in text
