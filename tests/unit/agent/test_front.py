"""The agent's filtering front: which routes it refuses, and what it forwards, streamed."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

import weightsync.engines
from tests.support.serving import serving
from weightsync.agent.front import ExposureWatch, Front, end_to_end, normalized_path, refusal
from weightsync.agent.service import Agent
from weightsync.agent.settings import AgentSettings
from weightsync.api.engines import PRIVATE_ROUTES
from weightsync.api.v1alpha1 import Engine
from weightsync.reference.engine import ReferenceEngine
from weightsync.reference.model import PRESETS, build_model
from weightsync.reference.server import make_app

ENGINES_DIR = Path(weightsync.engines.__file__).parent
# What the adapters read that the engines serve to everyone: health and served model.
PUBLIC_READS = {"/health", "/model_info"}


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("/v1/completions", "/v1/completions"),
        ("/v1/models?x=1#y", "/v1/models"),
        ("//collective_rpc", "/collective_rpc"),
        ("/%63ollective_rpc", "/collective_rpc"),
        ("/%2563ollective_rpc", "/collective_rpc"),  # escaped twice
        ("/v1/../collective_rpc", "/collective_rpc"),
        ("/v1/%2e%2e/collective_rpc", "/collective_rpc"),
        ("/./Collective_RPC/", "/collective_rpc"),
        ("/..\\collective_rpc", "/collective_rpc"),
        ("/../../", "/"),
        ("/", "/"),
    ],
)
def test_paths_are_read_as_an_engine_could_route_them(target: str, path: str) -> None:
    assert normalized_path(target) == path


@pytest.mark.parametrize(
    "target", ["http://engine/collective_rpc", "*", "", "/%25252563ollective_rpc"]
)
def test_targets_that_are_no_plain_path_are_not_read(target: str) -> None:
    assert normalized_path(target) is None


def _private_cases() -> list[tuple[Engine, str]]:
    return [
        (Engine(engine), prefix)
        for engine, groups in PRIVATE_ROUTES.items()
        for routes in groups
        for prefix in routes.prefixes
    ]


@pytest.mark.parametrize(("engine", "prefix"), _private_cases())
def test_every_private_route_is_refused_on_every_method(engine: Engine, prefix: str) -> None:
    for method in ("GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS", "post"):
        refused = refusal(engine, method, prefix)
        assert refused is not None
        assert refused.status == 403
        assert prefix in refused.detail


@pytest.mark.parametrize(
    ("engine", "target"),
    [
        (Engine.VLLM, "/collective_rpc"),
        (Engine.VLLM, "//collective_rpc"),
        (Engine.VLLM, "/%63ollective_rpc"),
        (Engine.VLLM, "/v1/%2E%2E/collective_rpc?method=x"),
        (Engine.VLLM, "/COLLECTIVE_RPC"),
        (Engine.VLLM, "/update_weights"),
        (Engine.VLLM, "/update_weight_version"),
        (Engine.VLLM, "/init_weight_transfer_engine"),
        (Engine.VLLM, "/sleep?level=2"),
        (Engine.VLLM, "/v1/admin/drain"),
        (Engine.SGLANG, "/update_weights_from_tensor"),
        (Engine.SGLANG, "/update_weights_from_distributed"),
        (Engine.SGLANG, "/release_memory_occupation"),
        (Engine.SGLANG, "/abort_requests"),
        (Engine.SGLANG, "/hicache/storage-backend"),
        (Engine.REFERENCE, "/v1/update/begin"),
        (Engine.REFERENCE, "/v1//update/attach"),
    ],
)
def test_private_routes_are_refused_however_written(engine: Engine, target: str) -> None:
    refused = refusal(engine, "POST", target)
    assert refused is not None
    assert refused.status == 403


@pytest.mark.parametrize(
    ("engine", "target"),
    [
        (Engine.VLLM, "/v1/completions"),
        (Engine.VLLM, "/v1/chat/completions"),
        (Engine.VLLM, "/v1/models"),
        (Engine.VLLM, "/health"),
        (Engine.VLLM, "/metrics"),
        (Engine.VLLM, "/tokenize"),
        (Engine.VLLM, "/load"),
        (Engine.SGLANG, "/generate"),
        (Engine.SGLANG, "/model_info"),
        (Engine.SGLANG, "/health_generate"),
        (Engine.SGLANG, "/v1/chat/completions"),
        (Engine.REFERENCE, "/generate"),
        (Engine.REFERENCE, "/v1/weights/digest"),
    ],
)
def test_inference_and_public_routes_are_forwarded(engine: Engine, target: str) -> None:
    assert refusal(engine, "POST", target) is None


def test_odd_methods_and_targets_are_answered_by_the_front() -> None:
    traced = refusal(Engine.VLLM, "TRACE", "/health")
    assert traced is not None
    assert traced.status == 405
    absolute = refusal(Engine.VLLM, "GET", "http://engine/collective_rpc")
    assert absolute is not None
    assert absolute.status == 400
    escaped = refusal(Engine.VLLM, "GET", "/%25252563ollective_rpc")  # four times
    assert escaped is not None
    assert escaped.status == 400


@pytest.mark.parametrize(
    ("engine", "module"), [(Engine.VLLM, "vllm.py"), (Engine.SGLANG, "sglang.py")]
)
def test_every_route_the_adapter_calls_is_private_but_the_public_reads(
    engine: Engine, module: str
) -> None:
    source = (ENGINES_DIR / module).read_text() + (ENGINES_DIR / "_rounds.py").read_text()
    called = set(re.findall(r'(?:\(|"(?:GET|POST)",)\s*"(/[a-z_]+)"', source))
    assert len(called) >= 8, called  # the pattern still finds the adapter's calls
    forwarded = {route for route in called if refusal(engine, "POST", route) is None}
    assert forwarded == PUBLIC_READS & called


def test_hop_by_hop_headers_and_those_connection_names_are_dropped() -> None:
    kept = end_to_end(
        CIMultiDict(
            [
                ("Connection", "keep-alive, X-Hop"),
                ("X-Hop", "1"),
                ("Keep-Alive", "timeout=5"),
                ("Transfer-Encoding", "chunked"),
                ("Upgrade", "h2c"),
                ("Authorization", "Bearer t"),
                ("X-Trace", "a"),
                ("X-Trace", "b"),
            ]
        )
    )
    assert list(kept.items()) == [("Authorization", "Bearer t"), ("X-Trace", "a"), ("X-Trace", "b")]


# -- the front in front of a real server ------------------------------------------------


class Upstream:
    """An engine stand-in that records what reaches it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.first_chunk_read = asyncio.Event()
        self.stream_ended: asyncio.Future[str] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{path:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.raw_path)
        if request.path == "/stream":
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            await reply.write(b"data: 0\n\n")
            # The next event only once the client has read the first through the front.
            await asyncio.wait_for(self.first_chunk_read.wait(), 10)
            await reply.write(b"data: 1\n\n")
            await reply.write_eof()
            return reply
        if request.path == "/endless":
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            ended = self.stream_ended
            assert ended is not None
            try:
                for event in range(1000):
                    await reply.write(b"data: %d\n\n" % event)
                    await asyncio.sleep(0.01)
            except ConnectionResetError:
                ended.set_result("client gone")
            return reply
        if request.path == "/broken":
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            await reply.write(b"data: 0\n\n")
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()  # the engine dies mid-reply
            return reply
        if request.path == "/gzip":
            body = gzip.compress(b"weights" * 100)
            return web.Response(body=body, headers={"Content-Encoding": "gzip"})
        digest, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_chunked(1 << 16):
            digest.update(chunk)
            size += len(chunk)
        return web.json_response(
            {"bytes": size, "sha256": digest.hexdigest(), "headers": dict(request.headers)},
            headers={"X-Engine": "yes"},
        )


@asynccontextmanager
async def fronted(engine: Engine, app: web.Application) -> AsyncIterator[str]:
    async with serving(app) as engine_port:
        front = Front(engine, f"http://127.0.0.1:{engine_port}", port=0)
        try:
            async with serving(front.app()) as front_port:
                yield f"127.0.0.1:{front_port}"
        finally:
            await front.close()


async def raw_status(address: str, target: str, method: str = "POST") -> tuple[int, bytes]:
    """The status and body of one request sent byte for byte, as a client could."""
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        "Connection: close\r\n\r\n{}".encode()
    )
    await writer.drain()
    reply = await reader.read()
    writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_private_routes_never_reach_the_engine_and_others_do() -> None:
    upstream = Upstream()

    async def run() -> None:
        async with fronted(Engine.VLLM, upstream.app()) as address:
            for target in ["/collective_rpc", "//collective_rpc", "/%63ollective_rpc",
                           "/v1/..%2Fupdate_weights", "/pause?mode=abort"]:  # fmt: skip
                status, body = await raw_status(address, target)
                assert status == 403, (target, body)
                answer = json.loads(body)
                assert answer["error"] == "private_route"
                assert "only the pod's weightsync agent calls" in answer["detail"]
            assert upstream.seen == []
            status, _ = await raw_status(address, "/v1/completions?stream=true")
            assert status == 200
            assert upstream.seen == ["/v1/completions?stream=true"]

    asyncio.run(run())


def test_streams_large_bodies_and_events_through() -> None:
    upstream = Upstream()
    body = os.urandom(48 << 20)

    async def run() -> None:
        async with (
            fronted(Engine.VLLM, upstream.app()) as address,
            aiohttp.ClientSession(auto_decompress=False) as client,
        ):
            base = f"http://{address}"

            # A body larger than any buffer, sent chunked: it arrives whole.
            async def chunks() -> AsyncIterator[bytes]:
                for start in range(0, len(body), 1 << 20):
                    yield body[start : start + (1 << 20)]

            headers = {"X-Request-Id": "r1", "Connection": "keep-alive, X-Hop", "X-Hop": "1"}
            async with client.post(f"{base}/v1/echo", data=chunks(), headers=headers) as reply:
                assert reply.status == 200
                assert reply.headers["X-Engine"] == "yes"
                seen = await reply.json()
            assert seen["bytes"] == len(body)
            assert seen["sha256"] == hashlib.sha256(body).hexdigest()
            forwarded = CIMultiDict(seen["headers"])
            assert forwarded["X-Request-Id"] == "r1"
            assert "X-Hop" not in forwarded
            # A client that waits for `100 Continue` gets it from the front.
            async with client.post(f"{base}/v1/echo", data=b"x" * 10, expect100=True) as reply:
                assert (await reply.json())["bytes"] == 10
            # Server-sent events arrive one by one: the second is only written once the
            # first has come through, so a buffering front would hang here.
            async with client.get(f"{base}/stream") as reply:
                assert reply.headers["Content-Type"] == "text/event-stream"
                assert await reply.content.readuntil(b"\n\n") == b"data: 0\n\n"
                upstream.first_chunk_read.set()
                assert await reply.content.read() == b"data: 1\n\n"
            # Encoded bodies pass as they are.
            async with client.get(f"{base}/gzip") as reply:
                assert reply.headers["Content-Encoding"] == "gzip"
                assert gzip.decompress(await reply.read()) == b"weights" * 100

    asyncio.run(run())


def test_an_unreachable_engine_is_a_502_saying_so() -> None:
    async def run() -> None:
        async with serving(web.Application()) as free:
            pass  # the port is closed again
        front = Front(Engine.VLLM, f"http://127.0.0.1:{free}", port=0)
        try:
            async with serving(front.app()) as port:
                status, body = await raw_status(f"127.0.0.1:{port}", "/v1/completions")
        finally:
            await front.close()
        assert status == 502
        assert json.loads(body)["error"] == "engine_unreachable"

    asyncio.run(run())


def test_the_reference_engine_behind_a_front_generates_and_refuses_updates() -> None:
    engine = ReferenceEngine(build_model(PRESETS["tiny"], seed=0))

    async def run() -> None:
        async with (
            fronted(Engine.REFERENCE, make_app(engine)) as address,
            aiohttp.ClientSession() as client,
        ):
            base = f"http://{address}"
            payload = {"input_ids": [[1, 2, 3]], "max_new_tokens": 2}
            async with client.post(f"{base}/generate", json=payload) as reply:
                assert reply.status == 200
                assert len((await reply.json())["output_ids"][0]) == 2
            async with client.post(f"{base}/v1/update/begin", json={"version": 7}) as reply:
                assert reply.status == 403
            async with client.get(f"{base}/health") as reply:
                health = await reply.json()
            assert health["detail"] != "updating"
            assert health["version"] is None

    asyncio.run(run())


def test_the_watch_tells_an_engine_on_loopback_from_one_on_every_interface() -> None:
    async def run() -> None:
        front = Front(Engine.REFERENCE, "http://127.0.0.1:1", port=9)
        # 127.0.0.2 stands for the pod's IP: a server bound to 127.0.0.1 does not answer
        # there, one bound to every interface does.
        async with serving(web.Application(), "127.0.0.1") as port:
            watch = ExposureWatch(front, "127.0.0.2", port)
            assert await watch.check() is False
            assert watch.status().engine_exposed is False
        async with serving(web.Application(), "0.0.0.0") as port:
            watch = ExposureWatch(front, "127.0.0.2", port)
            assert await watch.check() is True
            assert watch.status().model_dump() == {"port": 9, "engine_exposed": True}
        watch = ExposureWatch(front, "127.0.0.2", port)  # nothing listens any more
        assert await watch.check() is None

    asyncio.run(run())


def test_a_sink_agent_with_a_front_port_serves_it_and_reports_it(tmp_path: Path) -> None:
    async def run() -> None:
        async with serving(web.Application()) as engine_port:
            settings = AgentSettings(
                role="sink",
                token="t",
                engine=Engine.REFERENCE,
                engine_url=f"http://127.0.0.1:{engine_port}",
                front_port=18001,
                http_host="127.0.0.2",
                shm_dir=tmp_path,
            )
            agent = Agent(settings)
            try:
                assert agent.front is not None
                assert agent.front.upstream == f"http://127.0.0.1:{engine_port}"
                assert agent.exposure is not None
                assert agent.exposure.pod_ip == "127.0.0.2"
                assert agent.exposure.engine_port == engine_port
                await agent.exposure.check()
                status = await agent.status()
                assert status.front is not None
                assert status.front.model_dump() == {"port": 18001, "engine_exposed": False}
            finally:
                await agent.close()

    asyncio.run(run())


def test_a_reply_cut_on_either_side_is_cut_on_the_other(caplog: pytest.LogCaptureFixture) -> None:
    upstream = Upstream()

    async def run() -> None:
        upstream.stream_ended = asyncio.get_running_loop().create_future()
        async with fronted(Engine.VLLM, upstream.app()) as address:
            base = f"http://{address}"
            # The client leaves mid-generation: the engine sees it leave (and can abort).
            async with aiohttp.ClientSession() as client, client.get(f"{base}/endless") as reply:
                assert await reply.content.readuntil(b"\n\n") == b"data: 0\n\n"
            assert await asyncio.wait_for(upstream.stream_ended, 10) == "client gone"
            # The engine dies mid-reply: the client sees a cut reply, not a complete one.
            async with aiohttp.ClientSession() as client, client.get(f"{base}/broken") as reply:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await reply.read()

    asyncio.run(run())
    assert "broke off" in caplog.text
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= 40]  # no ERROR from aiohttp
