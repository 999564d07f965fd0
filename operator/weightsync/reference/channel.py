"""The reference engine's end of its update channel: a Unix socket server, no HTTP.

The messages, the protocol and the agent's end (the client) are in
`weightsync.engines.reference_channel`; this serves them, a thread per connection that
calls the engine directly.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

from pydantic import ValidationError

from weightsync.engines.base import EngineError
from weightsync.engines.reference_channel import (
    MAX_BUCKETS_PER_CONNECTION,
    REQUEST,
    ArenaReply,
    BeginRequest,
    FinishRequest,
    HandleRequest,
    LoadRequest,
    Reply,
    Request,
    StageRequest,
    TensorRow,
    slices,
    socket_name,
)
from weightsync.reference.arenas import BucketPlan
from weightsync.reference.served import ServedEngine
from weightsync.transfer.buffers import SlotError
from weightsync.transfer.handoff import ProtocolError, frame, recv_frame

log = logging.getLogger(__name__)


def _refusal(engine: ServedEngine, reason: str, message: str) -> Reply:
    return Reply(
        ok=False,
        version=engine.version,
        incarnation=engine.incarnation,
        reason=reason,
        message=message,
    )


def _event_handle(text: str | None) -> bytes | None:
    if text is None:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise EngineError("bad_request", f"after: not a base64 event handle: {exc}") from exc


class UpdateChannelServer:
    """Serves one engine's update API on a Unix socket, a thread per connection."""

    def __init__(self, engine: ServedEngine, address: str) -> None:
        self.engine = engine
        self.address = address
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()  # open ones, shut down by `close`
        self._connections_lock = threading.Lock()

    def start(self) -> None:
        """Bind and start accepting; raises `OSError` when the address is taken."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if not self.address.startswith("@"):
                Path(self.address).unlink(missing_ok=True)
            listener.bind(socket_name(self.address))
            if not self.address.startswith("@"):
                os.chmod(self.address, 0o660)  # the agent shares the pod's fsGroup
            listener.listen(4)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        threading.Thread(target=self._accept, name="ref-update-accept", daemon=True).start()
        log.info("update channel listening on %s", self.address)

    def close(self) -> None:
        self._closed.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            if not self.address.startswith("@"):
                Path(self.address).unlink(missing_ok=True)
        # Connections too: a closed server answers no one, as a dead process would.
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._closed.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(conn,), name="ref-update-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        state = _Connection()
        with self._connections_lock:
            self._connections.add(conn)
        with conn:
            try:
                self._serve_frames(conn, state)
            finally:
                with self._connections_lock:
                    self._connections.discard(conn)

    def _serve_frames(self, conn: socket.socket, state: _Connection) -> None:
        while not self._closed.is_set():
            try:
                body = recv_frame(conn)
            except (ProtocolError, OSError):
                return
            reply = self.handle(body, state)
            try:
                conn.sendall(frame(reply.model_dump_json().encode()))
            except OSError:
                return

    def handle(self, body: bytes, state: _Connection) -> Reply:
        """One request; every failure is a reply, never an exception."""
        engine = self.engine
        try:
            return self._answer(REQUEST.validate_json(body), state)
        except EngineError as exc:
            return _refusal(engine, exc.reason, str(exc))
        except ValidationError as exc:
            return _refusal(engine, "bad_request", str(exc))
        except SlotError as exc:  # an arena that cannot be described for another process
            return _refusal(engine, "unsupported", str(exc))

    def _answer(self, request: Request, state: _Connection) -> Reply:
        engine = self.engine
        if isinstance(request, StageRequest):
            staged = self._stage(request, state)
            return Reply(
                ok=True,
                version=engine.version,
                incarnation=engine.incarnation,
                arena=staged.arena,
                handle=staged.handle,
                copies=staged.copies,
            )
        if isinstance(request, HandleRequest):
            arena = engine.find_arena(request.arena)
            state.shared.add(arena.id)
            return Reply(
                ok=True, version=engine.version, arena=arena.id, handle=engine.arena_handle(arena)
            )
        if isinstance(request, LoadRequest):
            engine.load_plan(request.slot, state.plan(engine, request.bucket, request.tensors))
        elif isinstance(request, BeginRequest):
            engine.begin(request.version)
            if request.stage is not None:  # a direct round: every arena, now
                arenas = [self._stage(stage, state) for stage in request.stage]
                return Reply(
                    ok=True, version=engine.version, incarnation=engine.incarnation, staged=arenas
                )
        elif isinstance(request, FinishRequest):
            engine.commit(request.version, _event_handle(request.after))
        else:
            log.warning("update to version %d aborted: %s", request.version, request.reason)
            engine.abort(request.version)
        return Reply(ok=True, version=engine.version, incarnation=engine.incarnation)

    def _stage(self, request: StageRequest, state: _Connection) -> ArenaReply:
        engine = self.engine
        plan = state.plan(engine, request.bucket, request.tensors)
        arena = engine.stage(plan)
        handle = None
        if arena.id not in state.shared:
            handle = engine.arena_handle(arena)
            state.shared.add(arena.id)
        copies = arena.copies(plan) if request.tensors is not None else None
        return ArenaReply(arena=arena.id, handle=handle, copies=copies)


class _Connection:
    """What one agent connection has been told: bucket numbers, arenas it can map."""

    def __init__(self) -> None:
        self.plans: dict[int, BucketPlan] = {}
        self.shared: set[int] = set()

    def plan(
        self, engine: ServedEngine, bucket: int, tensors: list[TensorRow] | None
    ) -> BucketPlan:
        if tensors is not None:
            if len(self.plans) >= MAX_BUCKETS_PER_CONNECTION:
                self.plans.clear()
            self.plans[bucket] = engine.plan(slices(tensors))
        plan = self.plans.get(bucket)
        if plan is None:
            raise EngineError("bad_bucket", f"bucket {bucket} was never described")
        return plan
