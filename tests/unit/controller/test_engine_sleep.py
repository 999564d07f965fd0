"""The flag that lets a Colocated engine free memory, added by the pod webhook or refused.

Flag names as the installed engines parse them: vLLM 0.32 `engine/arg_utils.py`
(`--enable-sleep-mode`, a BooleanOptionalAction; its parser reads `_` as `-`), SGLang
0.5.23 `server_args.py` (`--enable-memory-saver`, store_true).
"""

from __future__ import annotations

from typing import Any

import jsonpatch
import kopf
import pytest

from tests.unit.api.builders import weightsync
from tests.unit.controller.builders import pod
from tests.unit.controller.test_admission import unreachable_api
from tests.unit.controller.test_injection import TEMPLATE, env_of, inject
from weightsync.api.v1alpha1 import Role
from weightsync.controller.admission.engine_sleep import EngineCannotSleepError
from weightsync.controller.admission.review import inject as admit
from weightsync.controller.cluster.cache import (
    REPLICASET_OWNERS_INDEX,
    WEIGHTSYNCS_INDEX,
    Indexes,
    replicaset_owner,
)

VLLM_FLAG = "--enable-sleep-mode"
SGLANG_FLAG = "--enable-memory-saver"


def colocated(engine: str, release: str = "KVCache") -> dict[str, Any]:
    return {
        "spec__mode": "Colocated",
        "spec__inference__0__engine": engine,
        "spec__colocated": {"memoryRelease": release},
    }


def engine_pod(**container: Any) -> dict[str, Any]:
    raw = pod("engine-a-abc-x1").build()
    raw["spec"]["containers"] = [{"name": "engine", "image": "engine:1", **container}]
    return raw


def engine_of(raw: dict[str, Any], role: Role = Role.SINK, **paths: Any) -> dict[str, Any]:
    _, patched = inject(raw, role, **paths)
    container: dict[str, Any] = patched["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("release", ["KVCache", "KVCacheAndWeights"])
def test_vllm_gets_sleep_mode_after_the_default_flags_and_keeps_dev_mode(release: str) -> None:
    raw = engine_pod(command=["vllm", "serve", "m"], args=["--port", "8000"])
    engine = engine_of(raw, **colocated("VLLM", release))
    assert engine["args"] == [
        "--port", "8000",
        "--weight-transfer-config", '{"backend": "ipc"}', "--load-format", "dummy",
        VLLM_FLAG,
    ]  # fmt: skip
    assert env_of(engine)["VLLM_SERVER_DEV_MODE"] == "1"  # /sleep, /wake_up, /is_sleeping


def test_sglang_gets_the_memory_saver_as_args_after_a_command_without_args() -> None:
    engine = engine_of(
        engine_pod(command=["python", "-m", "sglang.launch_server"]), **colocated("SGLang")
    )
    assert engine["args"] == ["--load-format", "dummy", SGLANG_FLAG]


@pytest.mark.parametrize(
    "spelled", [VLLM_FLAG, "--enable_sleep_mode", "--no-enable-sleep-mode --enable-sleep-mode"]
)
def test_a_flag_the_user_set_is_not_added_again(spelled: str) -> None:
    command = ["vllm", "serve", "m", *spelled.split(), "--load-format=dummy"]
    engine = engine_of(engine_pod(command=command), **colocated("VLLM"))
    assert engine["command"] == command
    assert engine["args"] == ["--weight-transfer-config", '{"backend": "ipc"}']


def test_sglang_memory_saver_in_args_is_not_duplicated() -> None:
    args = ["--model-path", "m", SGLANG_FLAG, "--load-format", "dummy"]
    engine = engine_of(
        engine_pod(command=["python3", "-m", "sglang.launch_server"], args=args),
        **colocated("SGLang"),
    )
    assert engine["args"] == args


@pytest.mark.parametrize("engine_name", ["VLLM", "SGLang"])
def test_no_flag_without_a_release_outside_colocated_or_for_the_reference_engine(
    engine_name: str,
) -> None:
    raw = engine_pod(command=["serve"])
    for paths in (
        {"spec__inference__0__engine": engine_name},  # Disaggregated: nothing to release
        colocated(engine_name, "None"),
    ):
        assert not {VLLM_FLAG, SGLANG_FLAG} & set(engine_of(raw, **paths)["args"])
    assert "args" not in engine_of(raw, **colocated("Reference"))
    # The trainer's pod is not an engine: its command line is the trainer's.
    trainer = engine_of(raw, Role.SOURCE, **colocated("VLLM"))
    assert "args" not in trainer


@pytest.mark.parametrize(
    ("container", "field", "says"),
    [
        ({}, "spec.containers[0] (engine)", "sets neither command nor args"),
        (
            {"command": ["sh", "-c", "vllm serve m --port 8000"]},
            "spec.containers[0].command",
            "through a shell (sh -c ...)",
        ),
        (
            {"command": ["/bin/bash"], "args": ["-ec", "exec vllm serve m"]},
            "spec.containers[0].command",
            "through a shell (/bin/bash -ec ...)",
        ),
        ({"command": ["bash", "/start.sh"]}, "spec.containers[0].command", "through a shell"),
        (
            {"command": ["vllm", "serve"], "args": ["m", "--no-enable-sleep-mode"]},
            "spec.containers[0]",
            "turns it off (--no-enable-sleep-mode)",
        ),
        (
            {"command": ["vllm", "serve"], "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "0"}]},
            "spec.containers[0].env[0]",
            "VLLM_SERVER_DEV_MODE='0', which hides /sleep",
        ),
    ],
)
def test_a_vllm_command_line_that_cannot_take_the_flag_is_refused_naming_the_field(
    container: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(EngineCannotSleepError) as refused:
        inject(engine_pod(**container), Role.SINK, **colocated("VLLM"))
    message = str(refused.value)
    assert message.startswith(field), message
    assert says in message
    assert "spec.colocated.memoryRelease KVCache needs VLLM started with --enable-sleep-mode" in (
        message
    )


@pytest.mark.parametrize(
    "script",
    [
        "python -m sglang.launch_server --model-path m --enable-memory-saver",
        "exec python -m sglang.launch_server --enable-memory-saver --port 30000 && true",
        "python -m sglang.launch_server '--enable-memory-saver'",
    ],
)
def test_a_shell_script_that_names_the_flag_itself_is_admitted_unchanged(script: str) -> None:
    engine = engine_of(engine_pod(command=["sh", "-c", script]), **colocated("SGLang"))
    assert engine["command"] == ["sh", "-c", script]
    assert engine["args"] == ["--load-format", "dummy"]  # the defaults, as before


def test_a_script_naming_a_longer_flag_is_not_taken_for_the_flag() -> None:
    script = "python -m sglang.launch_server --enable-memory-saver-extra"
    with pytest.raises(EngineCannotSleepError, match="add --enable-memory-saver"):
        inject(engine_pod(command=["sh", "-c", script]), Role.SINK, **colocated("SGLang"))


def test_the_webhook_refuses_the_pod_with_the_reason() -> None:
    """Through the handler: a 403 naming the field, the pod is not admitted unchanged."""
    manifest = (
        weightsync("sync")
        .namespace("ns")
        .set("spec.mode", "Colocated")
        .set("spec.inference.0.engine", "VLLM")
        .set("spec.colocated", {"memoryRelease": "KVCacheAndWeights"})
        .build()
    )
    replicaset = pod("engine-a-7d9").owned_by("Deployment", "engine-a").build()
    indexes = Indexes()
    indexes.bind(
        {
            WEIGHTSYNCS_INDEX: {"ns": [manifest]},
            REPLICASET_OWNERS_INDEX: {("ns", "engine-a-7d9"): [replicaset_owner(replicaset)]},
        }
    )
    body = pod("").owned_by("ReplicaSet", "engine-a-7d9").build()
    body["spec"]["containers"][0]["command"] = ["sh", "-c", "vllm serve m"]
    patch = kopf.Patch(body=kopf.Body(body))
    with pytest.raises(kopf.AdmissionError) as refused:
        admit(unreachable_api(), TEMPLATE, body, patch, indexes)
    assert refused.value.code == 403
    assert "spec.containers[0].command runs VLLM through a shell" in str(refused.value)
    assert not patch
    body["spec"]["containers"][0]["command"] = ["vllm", "serve", "m"]
    admit(unreachable_api(), TEMPLATE, body, patch, indexes)
    patched = jsonpatch.JsonPatch(patch.as_json_patch()).apply(body)
    assert VLLM_FLAG in patched["spec"]["containers"][0]["args"]
