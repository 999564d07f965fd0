"""The recordings, written from each engine's source, checked against adapter and fake.

Against the adapter: a server answers with the recorded replies and fails the test if a
request differs from the recorded one (method, path, query, body field by field). Against
the fake: every recorded request is sent and the reply must match the recorded one. The
fake and the adapter therefore agree with the same written-down contract, not merely with
each other.
"""

from __future__ import annotations

import copy
from typing import Any

import aiohttp
import pytest
import torch

from tests.unit.engines.fakes.common import serve
from tests.unit.engines.harness import SGLANG, VLLM, EngineCase
from tests.unit.engines.replay import (
    DRIVERS,
    ReplayServer,
    bucket_tensors,
    load_recording,
    pack_bucket,
    response_mismatch,
)
from tests.unit.engines.support import cpu_slots, pack, run

FILES = {"sglang": ("sglang-0.5.23.json", SGLANG), "vllm": ("vllm-0.33.0.json", VLLM)}


def _scenarios(*, for_adapter: bool) -> list[tuple[str, str]]:
    found = []
    for engine, (name, _) in FILES.items():
        for scenario, body in load_recording(name)["scenarios"].items():
            if for_adapter and body.get("driver") is None:
                continue
            if not for_adapter and body.get("fake") is False:
                continue
            found.append((engine, scenario))
    return found


def test_recordings_name_the_version_and_say_how_they_were_made() -> None:
    for name, _ in FILES.values():
        recording = load_recording(name)
        assert recording["version"] in name
        assert recording["written_from"]
        assert recording["scenarios"]["round"]["driver"] == "round"


@pytest.mark.parametrize(("engine", "scenario"), _scenarios(for_adapter=True))
def test_adapter_sends_the_recorded_requests(engine: str, scenario: str) -> None:
    name, case = FILES[engine]
    recording = load_recording(name)
    body = recording["scenarios"][scenario]
    server = ReplayServer(body["exchanges"])

    async def replay() -> None:
        async with serve(server.app()) as url:
            adapter = case.make_adapter(url, **body.get("settings", {}))
            slots = cpu_slots(1, 4096)
            await adapter.attach_buffers(slots)
            bucket = pack_bucket(slots[0], body.get("bucket", recording["bucket"]))
            await DRIVERS[body["driver"]](adapter, bucket)
            server.check_done()
            await adapter.close()

    run(replay())


def _materialize(
    case: EngineCase,
    request: dict[str, Any],
    builder: Any,
    slot: torch.Tensor,
    spec: list[dict[str, Any]],
) -> Any:
    """The recorded body with real payloads where the recording holds "<base64>"."""
    body = copy.deepcopy(request.get("json"))
    if case is SGLANG and isinstance(body, dict):
        payloads = body.get("serialized_named_tensors")
        if isinstance(payloads, list) and "<base64>" in payloads:
            real = builder.bucket_request(0, pack(slot, bucket_tensors(spec)))
            body["serialized_named_tensors"] = real["serialized_named_tensors"] * len(payloads)
    if case is VLLM and isinstance(body, dict) and isinstance(body.get("update_info"), dict):
        info = body["update_info"]
        if info.get("ipc_handles_pickled") == "<base64>":
            names = [
                {"name": n, "dtype": d, "shape": s}
                for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)
            ]
            (real,) = builder.bucket_requests(0, pack(slot, bucket_tensors(names)))
            info["ipc_handles_pickled"] = real["update_info"]["ipc_handles_pickled"]
    return body


@pytest.mark.parametrize(("engine", "scenario"), _scenarios(for_adapter=False))
def test_fake_answers_as_recorded(engine: str, scenario: str) -> None:
    name, case = FILES[engine]
    recording = load_recording(name)
    spec = recording["bucket"]
    model = {
        name: torch.zeros(item["shape"], dtype=getattr(torch, item["dtype"]))
        for item in spec
        for name in [item["name"]]
    }
    fake = case.make_fake(model)
    for attribute, value in recording["scenarios"][scenario].get("fake_state", {}).items():
        setattr(fake, attribute, value)
    builder = case.make_adapter("http://127.0.0.1:1")
    slots = cpu_slots(1, 4096)

    async def replay() -> None:
        await builder.attach_buffers(slots)
        async with serve(fake.app()) as url, aiohttp.ClientSession() as session:
            for index, exchange in enumerate(recording["scenarios"][scenario]["exchanges"]):
                request = exchange["request"]
                body = _materialize(case, request, builder, slots[0], spec)
                async with session.request(
                    request["method"],
                    url + request["path"],
                    params=request.get("query"),
                    json=body if "json" in request else None,
                ) as response:
                    text = await response.text()
                problem = response_mismatch(exchange["response"], response.status, text)
                assert problem is None, f"exchange {index + 1} {request['path']}: {problem}"

    run(replay())
    if scenario == "round":
        for tensor_name, tensor in bucket_tensors(spec):
            assert torch.equal(fake.model[tensor_name], tensor)


def test_replay_fails_on_a_request_that_differs_from_the_recording() -> None:
    recording = load_recording("sglang-0.5.23.json")
    exchanges = copy.deepcopy(recording["scenarios"]["round"]["exchanges"])
    exchanges[1]["request"]["json"] = {"mode": "retract"}  # the adapter will send "abort"
    server = ReplayServer(exchanges)

    async def replay() -> None:
        async with serve(server.app()) as url:
            adapter = SGLANG.make_adapter(url)
            await adapter.attach_buffers(cpu_slots(1, 4096))
            with pytest.raises(Exception, match="599"):
                await adapter.begin_update(1)
            await adapter.close()

    run(replay())
    assert server.problems
    assert "'abort' != 'retract'" in server.problems[0]
