"""The reference engine's update channel: the update API on a Unix socket, no HTTP.

Here: the messages and the agent's end (the client the adapter uses); the engine's end
(the server) is `weightsync.reference.channel`.

A round hands the engine one request per bucket, and each one sits between two bucket
transfers on the sink's critical path. Over HTTP a request cost a connection-pool
checkout, header parsing, a hop to the server's executor and JSON validation of every
tensor's metadata (about a millisecond, more than a 512 MiB bucket's time on NVLink).
Here a request is one length-prefixed JSON frame on a connection held for the agent's
lifetime, answered by a thread of the engine that calls the engine directly; a bucket's
tensor list crosses once per connection and later loads name it by number.

    agent (adapter)                              engine
    {"op":"begin","version":v}          ->
                                        <-       {"ok":true,"version":<served>}
    {"op":"stage","bucket":b,"tensors":[...]}   (tensors the first time only)
                                        <-       {"ok":true,"arena":id,"handle":{...},
                                                  "copies":[[slot_off, arena_off, n]]}
    (the agent copies its slot into the arena, in its own process, then the next bucket)
    {"op":"finish","version":v} / {"op":"abort",...}

A direct round (the agent packs the trainer's tensors straight into the arenas) stages
every bucket in its begin: `{"op":"begin","version":v,"stage":[<stage requests>]}` is
answered with `"staged":[{"arena":..,"handle":..,"copies":..}]`, one round trip for the
round's begin and every arena instead of one per bucket before its first copy.

`stage` hands out the bucket's staging arena (a handle the first time this connection
sees that arena, the copy spans the first time it sees the bucket): the agent does the
copy, so on a GPU all of a round's GPU work stays in the agent's process. `load` (the
engine copies from the slot itself, replying when done) serves engines whose arenas
cannot be shared. Errors are replies with `ok: false`, a `reason` (an `EngineError`
label) and a message.
The engine announces the channel's address in its attach reply; `@name` is a Linux
abstract socket name, which needs no shared volume between the containers of a pod
(they share a network namespace), anything else a filesystem path. An adapter that
cannot reach the address uses HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from weightsync.api.reasons import EngineErrorReason
from weightsync.engines._ipc import torch_dtype
from weightsync.engines.base import EngineError
from weightsync.transfer.buffers import SlotHandle, copy_tensors
from weightsync.transfer.handoff import ProtocolError, frame, read_frame
from weightsync.transfer.layout import TensorSlice

TensorRow = tuple[str, str, list[int], int, int]  # name, dtype, shape, offset, nbytes
MAX_BUCKETS_PER_CONNECTION = 1 << 16


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LoadRequest(_Request):
    op: Literal["load"] = "load"
    slot: int = Field(ge=0)
    bucket: int = Field(ge=0)  # the connection's number for this tensor list
    tensors: list[TensorRow] | None = None  # sent with a bucket number's first use


class StageRequest(_Request):
    op: Literal["stage"] = "stage"
    bucket: int = Field(ge=0)
    tensors: list[TensorRow] | None = None


class BeginRequest(_Request):
    op: Literal["begin"] = "begin"
    version: int = Field(ge=0)
    stage: list[StageRequest] | None = None  # buckets staged in the same round trip


class HandleRequest(_Request):
    """The handle of an arena again (the agent let its mapping go)."""

    op: Literal["handle"] = "handle"
    arena: int = Field(ge=1)


class FinishRequest(_Request):
    op: Literal["finish"] = "finish"
    version: int = Field(ge=0)
    # An interprocess CUDA event's handle (base64): the engine commits once it completed
    # (a direct round's copies into its arenas, still running when the agent asked).
    after: str | None = None


class AbortRequest(_Request):
    op: Literal["abort"] = "abort"
    version: int = Field(ge=0)
    reason: str = ""


Request = Annotated[
    BeginRequest | LoadRequest | StageRequest | HandleRequest | FinishRequest | AbortRequest,
    Field(discriminator="op"),
]
REQUEST: TypeAdapter[Request] = TypeAdapter(Request)


class ArenaReply(BaseModel):
    """One bucket's arena in a staging begin's reply (as a `stage` reply says it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arena: int
    handle: SlotHandle | None = None
    copies: list[tuple[int, int, int]] | None = None


class Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    ok: bool
    version: int | None = None
    incarnation: str | None = None  # the engine process that answered
    reason: str = ""
    message: str = ""
    arena: int | None = None  # stage: the arena to fill
    handle: SlotHandle | None = None  # stage: how to map it, the first time
    copies: list[tuple[int, int, int]] | None = None  # stage: spans, the first time
    staged: list[ArenaReply] | None = None  # begin with `stage`: each bucket's arena


@dataclass(frozen=True, slots=True)
class Staged:
    """Where the agent copies a bucket: an arena (mapped once) and the spans to copy."""

    arena: int
    handle: SlotHandle | None
    copies: list[tuple[int, int, int]]  # (slot offset, arena offset, bytes)
    incarnation: str | None = None  # the engine process that staged it


def socket_name(address: str) -> str:
    """The `bind`/`connect` name for an address: `@name` is abstract, else a path."""
    return "\0" + address[1:] if address.startswith("@") else address


def rows(tensors: Sequence[TensorSlice]) -> list[TensorRow]:
    return [(t.name, t.dtype, list(t.shape), t.offset, t.nbytes) for t in tensors]


def slices(tensor_rows: Sequence[TensorRow]) -> list[TensorSlice]:
    return [TensorSlice(n, d, tuple(s), o, b) for n, d, s, o, b in tensor_rows]


class UpdateChannelClient:
    """The adapter's end: one connection, one request at a time, reconnected on demand.

    A request that fails or is cancelled half-way drops the connection (its reply may
    still come), and the next one reconnects; bucket numbers are per connection.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._lock = asyncio.Lock()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._by_identity: dict[int, tuple[Sequence[TensorSlice], int]] = {}
        self._by_content: dict[tuple[TensorSlice, ...], int] = {}
        self._copies: dict[int, list[tuple[int, int, int]]] = {}

    async def call(self, request: _Request) -> Reply:
        async with self._lock:
            return await self._call(request)

    async def load(self, slot: int, tensors: Sequence[TensorSlice]) -> Reply:
        async with self._lock:
            await self._ensure()
            number, new = self._number(tensors)
            described = rows(tensors) if new else None
            return await self._call(LoadRequest(slot=slot, bucket=number, tensors=described))

    async def stage(self, tensors: Sequence[TensorSlice]) -> Reply | Staged:
        """The arena to copy a bucket into, or the engine's refusal."""
        async with self._lock:
            await self._ensure()
            number, new = self._number(tensors)
            described = rows(tensors) if new else None
            reply = await self._call(StageRequest(bucket=number, tensors=described))
            if not reply.ok:
                return reply
            return self._staged(number, reply.arena, reply.handle, reply.copies, reply)

    async def begin(
        self, version: int, buckets: Sequence[Sequence[TensorSlice]]
    ) -> Reply | list[Staged]:
        """Open an update and stage each of `buckets` in the same round trip: their arenas
        in order, or the engine's refusal (the update may be open then: abort it)."""
        async with self._lock:
            await self._ensure()
            numbered = [self._number(tensors) for tensors in buckets]
            if self._writer is None:  # numbering started afresh half-way: number them all
                await self._ensure()
                numbered = [self._number(tensors) for tensors in buckets]
            stage = [
                StageRequest(bucket=number, tensors=rows(tensors) if new else None)
                for tensors, (number, new) in zip(buckets, numbered, strict=True)
            ]
            reply = await self._call(BeginRequest(version=version, stage=stage))
            if not reply.ok:
                return reply
            if reply.staged is None or len(reply.staged) != len(buckets):
                self._drop()
                raise ProtocolError(f"begin staged {len(reply.staged or [])} of {len(buckets)}")
            return [
                self._staged(number, a.arena, a.handle, a.copies, reply)
                for (number, _), a in zip(numbered, reply.staged, strict=True)
            ]

    def _staged(
        self,
        number: int,
        arena: int | None,
        handle: SlotHandle | None,
        copies: list[tuple[int, int, int]] | None,
        reply: Reply,
    ) -> Staged:
        """Where bucket `number` goes, the copy spans kept from their first reply."""
        if copies is not None:
            self._copies[number] = copies
        known = self._copies.get(number)
        if arena is None or known is None:
            self._drop()
            raise ProtocolError("stage reply without an arena or copy spans")
        return Staged(arena, handle, known, reply.incarnation)

    async def handle(self, arena: int) -> Reply:
        """An arena's handle again, for an adapter that no longer maps it."""
        return await self.call(HandleRequest(arena=arena))

    def _number(self, tensors: Sequence[TensorSlice]) -> tuple[int, bool]:
        """This connection's number for a tensor list, and whether the engine lacks it."""
        known = self._by_identity.get(id(tensors))
        if known is not None and known[0] is tensors:  # the layout's own tuple, every round
            return known[1], False
        key = tuple(tensors)
        number = self._by_content.get(key)
        new = number is None
        if number is None:
            if len(self._by_content) >= MAX_BUCKETS_PER_CONNECTION:
                self._drop()  # the engine forgets too: a new connection starts afresh
                return self._number(tensors)
            number = self._by_content[key] = len(self._by_content)
        if isinstance(tensors, tuple):
            if len(self._by_identity) >= MAX_BUCKETS_PER_CONNECTION:
                self._by_identity.clear()
            self._by_identity[id(tensors)] = (tensors, number)
        return number, new

    async def connect(self) -> None:
        """Open the connection now (attach), so that an unreachable address shows early."""
        async with self._lock:
            await self._ensure()

    async def _ensure(self) -> None:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_unix_connection(
                socket_name(self.address)
            )

    async def _call(self, request: _Request) -> Reply:
        await self._ensure()
        reader, writer = self._reader, self._writer
        if reader is None or writer is None:
            raise ProtocolError("update channel not connected")
        try:
            writer.write(frame(request.model_dump_json(exclude_none=True).encode()))
            await writer.drain()
            body = await read_frame(reader)
        except BaseException:
            self._drop()  # a reply may still be on its way: never read it as the next one's
            raise
        try:
            return Reply.model_validate_json(body)
        except ValidationError as exc:
            self._drop()
            raise ProtocolError(f"invalid update channel reply: {exc}") from exc

    def _drop(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        self._by_identity.clear()
        self._by_content.clear()
        self._copies.clear()
        if writer is not None:
            writer.close()

    async def close(self) -> None:
        async with self._lock:
            writer = self._writer
            self._drop()
            if writer is not None:
                with contextlib.suppress(OSError, ConnectionError):
                    await writer.wait_closed()


def arena_views(
    arena: torch.Tensor, copies: list[tuple[int, int, int]], tensors: Sequence[TensorSlice]
) -> list[torch.Tensor]:
    """Where each of a bucket's `tensors` lands in its arena, as typed views: each lies
    within one span of `copies` (slot offset, arena offset, bytes)."""
    views = []
    for t in tensors:
        end = t.offset + t.nbytes
        span = next((c for c in copies if c[0] <= t.offset and end <= c[0] + c[2]), None)
        at = None if span is None else span[1] + t.offset - span[0]
        if at is None or at + t.nbytes > arena.numel():
            raise EngineError(EngineErrorReason.BAD_BUCKET, f"{t.name} lies outside its arena")
        views.append(arena[at : at + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape))
    return views


def copy_spans(
    source: torch.Tensor,
    arena: torch.Tensor,
    copies: list[tuple[int, int, int]],
    stream: torch.cuda.Stream | None,
) -> None:
    """Copy the spans of a slot into an arena; return once the copy is complete."""
    destinations = [arena[at : at + nbytes] for _, at, nbytes in copies]
    sources = [source[start : start + nbytes] for start, _, nbytes in copies]
    if stream is None:
        copy_tensors(destinations, sources)
        return
    # After whatever the agent queued that writes the slot (the receive, its holder copy).
    stream.wait_stream(torch.cuda.current_stream(source.device))
    with torch.cuda.stream(stream):
        copy_tensors(destinations, sources)
    stream.synchronize()
    if arena.device != source.device:
        torch.cuda.synchronize(arena.device)
