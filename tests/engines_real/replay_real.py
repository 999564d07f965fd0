"""Replay every recorded exchange (tests/unit/engines/recordings) against a real server.

The fakes answer as the recordings say (`test_recordings.py`); this checks that the real
servers answer as the recordings say too, so a fake cannot drift from the engine it
stands in for. Each scenario starts from a served, unpaused engine without an update
session; its requests, including those sent by "someone else" (`by`), go to the real
server in order and every reply must match the recorded one (placeholders as in
`tests/unit/engines/replay.py`).

Payloads are made for real: SGLang's flattened bucket over torch's shared memory, and for
vLLM the weightsync_shm handle in place of the recorded `ipc_handles_pickled` (the only
field a CPU server cannot read; the rest of `update_info` is sent as recorded).

    python -m tests.engines_real.replay_real record vllm|sglang URL

re-records the replies of a running server into the recording, keeping placeholders.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import urllib.error
import urllib.request
from typing import Any

import torch

from tests.unit.engines.replay import RECORDINGS, bucket_tensors, load_recording, response_mismatch
from tests.unit.engines.support import pack
from weightsync.engines.sglang import SGLangAdapter
from weightsync.engines.vllm import VLLMAdapter
from weightsync.transfer.buffers import BucketSlots

FILES = {"vllm": "vllm-0.33.0.json", "sglang": "sglang-0.5.23.json"}


# Only the handle differs between the ipc backend the recording was made for and the CPU
# server's weightsync_shm backend; vLLM names the backend's classes in some messages.
SAME_ROLE = {
    "SharedMemoryWeightTransferEngine": "IPCWeightTransferEngine",
    "SharedMemoryUpdateInfo": "IPCWeightTransferUpdateInfo",
}


def _send(url: str, request: dict[str, Any], body: Any) -> tuple[int, str]:
    query = request.get("query")
    target = url + request["path"]
    if query:
        target += "?" + "&".join(f"{key}={value}" for key, value in query.items())
    data = json.dumps(body).encode() if "json" in request else None
    sent = urllib.request.Request(target, data=data, method=request["method"])  # noqa: S310
    if data is not None:
        sent.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(sent, timeout=120) as reply:  # noqa: S310 - loopback
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    for ours, theirs in SAME_ROLE.items():
        text = text.replace(ours, theirs)
    return status, text


def _reset(url: str, engine: str) -> None:
    """A served, unpaused engine with no update session open, at weight_version default."""
    if engine == "vllm":
        _send(url, {"method": "POST", "path": "/finish_weight_update"}, None)
        _send(url, {"method": "POST", "path": "/resume"}, None)
        version = {"method": "POST", "path": "/update_weight_version", "json": None}
        _send(url, version, {"new_version": "default"})
    else:
        _send(url, {"method": "POST", "path": "/end_weight_update", "json": None}, {})
        _send(url, {"method": "POST", "path": "/continue_generation", "json": None}, {})
        version = {"method": "POST", "path": "/update_weight_version", "json": None}
        _send(url, version, {"new_version": "default", "abort_all_requests": False})


class Payloads:
    """Real bucket payloads for a recording's "<base64>" fields, from /dev/shm slots."""

    def __init__(self, url: str) -> None:
        self.slots = BucketSlots(1, 1 << 16, torch.device("cpu"), "/dev/shm")
        self.vllm = VLLMAdapter(url)
        self.sglang = SGLangAdapter(url)
        asyncio.run(self.vllm.attach_buffers(self.slots.slots))
        asyncio.run(self.sglang.attach_buffers(self.slots.slots))

    def materialize(self, engine: str, request: dict[str, Any], spec: list[dict[str, Any]]) -> Any:
        body = copy.deepcopy(request.get("json"))
        if engine == "sglang" and isinstance(body, dict):
            payloads = body.get("serialized_named_tensors")
            if isinstance(payloads, list) and "<base64>" in payloads:
                real = self.sglang.bucket_request(
                    0, pack(self.slots.slots[0], bucket_tensors(spec))
                )
                body["serialized_named_tensors"] = real["serialized_named_tensors"] * len(payloads)
        if (
            engine == "vllm"
            and isinstance(body, dict)
            and isinstance(body.get("update_info"), dict)
        ):
            info = body["update_info"]
            if info.pop("ipc_handles_pickled", None) == "<base64>":
                named = [
                    {"name": n, "dtype": d, "shape": s}
                    for n, d, s in zip(
                        info["names"], info["dtype_names"], info["shapes"], strict=True
                    )
                ]
                (real,) = self.vllm.bucket_requests(
                    0, pack(self.slots.slots[0], bucket_tensors(named))
                )
                info.update(shm_path=real["update_info"]["shm_path"])
                info.update(shm_offset=real["update_info"]["shm_offset"])
        return body

    def close(self) -> None:
        self.slots.close()


def _real_scenarios(recording: dict[str, Any]) -> dict[str, Any]:
    return {
        name: body for name, body in recording["scenarios"].items() if body.get("fake") is not False
    }


def replay(url: str, engine: str, *, record: bool = False) -> list[str]:
    """Every difference between the recording and the real server's replies."""
    recording = load_recording(FILES[engine])
    payloads = Payloads(url)
    problems: list[str] = []
    try:
        for name, scenario in _real_scenarios(recording).items():
            _reset(url, engine)
            # Other keys only configure the fake (to answer as the real server does).
            state = scenario.get("fake_state", {})
            if "weight_version" in state:
                body = {"new_version": state["weight_version"]}
                if engine == "sglang":
                    body["abort_all_requests"] = False
                _send(url, {"method": "POST", "path": "/update_weight_version", "json": None}, body)
            spec = scenario.get("bucket", recording["bucket"])
            for index, exchange in enumerate(scenario["exchanges"]):
                request = exchange["request"]
                status, text = _send(url, request, payloads.materialize(engine, request, spec))
                problem = response_mismatch(exchange["response"], status, text)
                if problem and record:
                    exchange["response"] = _rerecorded(exchange["response"], status, text)
                elif problem:
                    problems.append(
                        f"{name}[{index}] {request['method']} {request['path']}: {problem}"
                    )
            _reset(url, engine)
    finally:
        payloads.close()
    if record:
        (RECORDINGS / FILES[engine]).write_text(json.dumps(recording, indent=2) + "\n")
    return problems


def _rerecorded(recorded: dict[str, Any], status: int, text: str) -> dict[str, Any]:
    """The real reply, keeping the recording's placeholders where the shapes agree."""
    try:
        body = json.loads(text)
    except ValueError:
        return {"status": status, "text": text}
    return {"status": status, "json": _keep_placeholders(recorded.get("json"), body)}


def _keep_placeholders(recorded: Any, real: Any) -> Any:
    if isinstance(recorded, str) and recorded.startswith("<") and recorded.endswith(">"):
        return recorded
    if isinstance(recorded, dict) and isinstance(real, dict):
        return {key: _keep_placeholders(recorded.get(key), value) for key, value in real.items()}
    return real


def main() -> int:
    _, mode, engine, url = sys.argv
    problems = replay(url, engine, record=mode == "record")
    print("\n".join(problems) or "no differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
