"""The Publisher <-> source agent hand-off protocol over a Unix socket.

Frames are a 4-byte big-endian length and a JSON message; no pickle, no tensor data.
Tensor bytes travel through the shared bucket slots (`buffers.SlotHandles`).

    Publisher                         source agent
    Attach(tensors)          ->                         (first publish, or a new tensor set)
                             <-  Attached(layout_hash, bucket settings, slot handles)
    Publish(version, hash)   ->
                             <-  Fill(bucket k, slot k % depth)     (up to depth ahead)
    Filled(k)                ->                          (slot k now holds bucket k)
    ...                                                  (agent broadcasts k, frees slot)
                             <-  PublishResult(version, ok, duration, bytes, reason)
    Fence(version, clean)    ->                      (only after a result with `holding`)
                             <-  Fenced(version, held)
    Release                  ->                      (Colocated: before the trainer trains)
                             <-  Released(tags)

On GPU the Publisher shares its tensors once in `Attach.sources` (CUDA IPC); when the agent
can map them (`Attached.agent_packs`), it packs every bucket itself, in the process and on
the GPU stream that broadcasts it (two processes' kernels on one GPU are time-sliced, not
overlapped), and a round is just `Publish` -> `PublishResult`: the Publisher synchronises
its device first, so the agent reads finished weights, and does not touch them until the
result comes. A tensor set whose storages moved is attached again.

Where that agent holds the version for recovery, its device-to-host copy of the tensors
may outlast the round: the result then says `holding`, and the Publisher sends `Fence`
before it writes the tensors again (an optimizer step, or its next publish). The agent
answers once nothing reads them, and keeps the copy as the held version only if the
Publisher says the tensors were not written meanwhile (`clean`).

A trainer rank of a sharded model (several source ranks, each with its own Publisher and
agent) attaches the global shape of every tensor it publishes and, in `Attach.boxes`, the
block of it that it holds (`transfer.shards.Box`). Its agent asks it to fill only its own
pieces, each at the byte offset in the slot that `Fill.pieces` names; the first `Fill` of
a round carries new slot handles when the round's layout needed larger slots.

`Release` frees the Colocated engine's memory as the plan's `memory_release` says; the
next `Publish` wakes it (weights, the round, then the KV cache: `agent.colocated`).

A Publisher that cannot fill a bucket sends `Abandon`; the agent still drives the
round to its end so every rank fails it together, then answers `PublishResult(ok=False)`.
Any request may be answered by `HandoffError` (e.g. `layout_mismatch`, `no_group`).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from weightsync.transfer.buffers import SlotHandles, TensorSources

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # an 18k-tensor Attach is ~2 MB; anything near this is a bug


class ProtocolError(RuntimeError):
    """The peer sent something that is not a valid frame or message, or went away."""


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# Sharded sources: per tensor, the [offset, shape] block a rank holds, or None (nothing);
# and the (tensor name, slot byte offset) of each piece a rank copies into a slot.
Boxes = list[tuple[list[int], list[int]] | None]
Pieces = list[tuple[str, int]]


class Attach(_Msg):
    type: Literal["attach"] = "attach"
    tensors: list[tuple[str, list[int], str]]  # name, (global) shape, dtype name
    sources: TensorSources | None = None  # GPU: the tensors themselves, for the agent to pack
    # Sharded: per tensor, [offset, shape] of the block this rank holds, or None (nothing);
    # absent: every tensor is held whole.
    boxes: Boxes | None = None


class Attached(_Msg):
    type: Literal["attached"] = "attached"
    layout_hash: str
    bucket_size_bytes: int
    alignment: int
    slots: SlotHandles
    agent_packs: bool = False  # the agent mapped the sources: no Fill requests will come


class Publish(_Msg):
    type: Literal["publish"] = "publish"
    version: int = Field(ge=0, strict=True)  # no coercion: "13" is not a version
    # One per Publisher: versions rise within it; a new one (a restarted trainer) may
    # start anywhere, and engines follow it.
    lineage: str = Field(min_length=1, max_length=64)
    layout_hash: str


class Fill(_Msg):
    type: Literal["fill"] = "fill"
    bucket: int
    slot: int
    # Sharded: (tensor name, byte offset in the slot) of each piece this rank sends in the
    # bucket, its local block copied contiguously; absent: the whole bucket, as laid out.
    pieces: Pieces | None = None
    # Sharded: the slots were reallocated for the round's layout (known only once every
    # rank's report is in): map these before filling.
    slots: SlotHandles | None = None


class Filled(_Msg):
    type: Literal["filled"] = "filled"
    bucket: int


class Abandon(_Msg):
    type: Literal["abandon"] = "abandon"
    reason: str
    message: str = ""


class PublishResult(_Msg):
    """How a round ended, as the Publisher's `publish()` returns it."""

    type: Literal["publish_result"] = "publish_result"
    version: int
    ok: bool  # every engine serves exactly this version's bytes
    duration_seconds: float  # as measured by the agent, header to commit
    bytes: int
    reason: str = ""  # a short label when not ok, e.g. "engine_timeout", "member_lost"
    message: str = ""  # who failed, at which stage, and what it said
    generation: int | None = None
    member: str = ""  # failed: "pod (rank r, role)" the failure is put down to
    stage: str = ""  # failed: prepare, transfer, timeout, engine_load or commit
    # The agent's copy of the tensors for its holder still reads them: `Fence` first.
    holding: bool = False


class Fence(_Msg):
    """The Publisher is about to write the tensors of round `version`; `clean`: it has
    not written them since that round (else the agent drops its copy of them)."""

    type: Literal["fence"] = "fence"
    version: int
    clean: bool


class Fenced(_Msg):
    type: Literal["fenced"] = "fenced"
    version: int
    held: bool  # the agent holds `version` for recovery pulls


class Release(_Msg):
    type: Literal["release"] = "release"


class Released(_Msg):
    type: Literal["released"] = "released"
    tags: list[str]  # what the engine has released now (`api.engines.MemoryTag` values)


class HandoffError(_Msg):
    type: Literal["error"] = "error"
    reason: str
    message: str


Message = Annotated[
    Attach
    | Attached
    | Publish
    | Fill
    | Filled
    | Abandon
    | PublishResult
    | Fence
    | Fenced
    | Release
    | Released
    | HandoffError,
    Field(discriminator="type"),
]
_MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)


def encode(message: BaseModel) -> bytes:
    return frame(message.model_dump_json().encode())


def frame(body: bytes) -> bytes:
    """A frame: the body's length (4 bytes, big-endian), then the body."""
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> Message:
    try:
        return _MESSAGE.validate_json(body)
    except ValueError as exc:
        raise ProtocolError(f"invalid hand-off message: {exc}") from exc


def _check_length(length: int) -> int:
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return length


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame's body from a stream; `ProtocolError` when the peer closed it."""
    try:
        header = await reader.readexactly(_HEADER.size)
        return await reader.readexactly(_check_length(_HEADER.unpack(header)[0]))
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("peer closed the connection") from exc


async def read_message(reader: asyncio.StreamReader) -> Message:
    return decode(await read_frame(reader))


async def write_message(writer: asyncio.StreamWriter, message: _Msg) -> None:
    writer.write(encode(message))
    await writer.drain()


def recv_frame(sock: socket.socket) -> bytes:
    """One frame's body from a blocking socket; `ProtocolError` when the peer closed it."""
    header = _recv_exact(sock, _HEADER.size)
    return _recv_exact(sock, _check_length(_HEADER.unpack(header)[0]))


def recv_message(sock: socket.socket) -> Message:
    return decode(recv_frame(sock))


def send_message(sock: socket.socket, message: _Msg) -> None:
    sock.sendall(encode(message))


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ProtocolError("peer closed the connection")
        chunks += chunk
    return bytes(chunks)
