"""`ReferenceEngineAdapter`: drives the reference engine's update API.

Slots are attached over HTTP; the attach reply names the engine's update channel (a
Unix socket, see `reference_channel.py`) and whether its staging arenas can be shared. Then, per
bucket, the adapter asks the engine for the bucket's arena and copies the slot into it
itself, in the agent's process (`stage`), so that on a GPU the copy runs beside the
agent's NCCL receive of the next bucket instead of being time-sliced against it; it
returns once the copy is complete, as `load_bucket` must. An engine whose arenas cannot
be mapped here copies from the slot itself (`load`), over the channel or, without one
(or when the agent cannot reach it, e.g. another network namespace), over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, Self, TypeVar

import aiohttp
import torch

from weightsync.api.engines import MemoryTag
from weightsync.api.reasons import EngineErrorReason
from weightsync.engines.base import EngineAdapter, EngineError, EngineHealth
from weightsync.engines.reference_arenas import CopiesEvents, MappedArenas, event_handle
from weightsync.engines.reference_channel import (
    AbortRequest,
    BeginRequest,
    FinishRequest,
    Reply,
    Staged,
    UpdateChannelClient,
    copy_spans,
    rows,
)
from weightsync.transfer.buffers import (
    SlotError,
    SlotHandles,
    describe_slots,
    open_slots,
)
from weightsync.transfer.handoff import ProtocolError
from weightsync.transfer.layout import TensorSlice

if TYPE_CHECKING:
    from weightsync.api.engines import EngineOptions

log = logging.getLogger(__name__)

T = TypeVar("T")


class ReferenceEngineAdapter(EngineAdapter):
    """One engine: HTTP for attach and health, the update channel for each round."""

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_seconds: float = 60.0,
        use_channel: bool = True,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout_seconds = request_timeout_seconds
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_seconds)
        self._use_channel = use_channel
        self._session: aiohttp.ClientSession | None = None
        self._channel: UpdateChannelClient | None = None
        self._slots: list[torch.Tensor] = []
        self._incarnation: str | None = None  # the engine process the slots went to
        self._push = False  # the engine's arenas are mapped here and filled by us
        self._arenas = MappedArenas()  # the engine's staging arenas mapped here
        self._copier: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._events = CopiesEvents()  # a direct round's copies, for the engine to await

    @classmethod
    def for_engine(cls, base_url: str, options: EngineOptions | None = None) -> Self:
        # The reference engine has no pause modes or cache: it stages and swaps.
        return cls(base_url)

    @property
    def channel_address(self) -> str | None:
        """The update channel in use, or None while the adapter uses HTTP."""
        return self._channel.address if self._channel is not None else None

    @property
    def attached_to(self) -> str | None:
        return self._incarnation

    def _same_engine(self, incarnation: object, what: str) -> None:
        """Raise `restarted` (and forget the old process's mappings) if another engine
        process than the attached one answered."""
        if self._incarnation is None or incarnation in (None, self._incarnation):
            return
        old = self._incarnation
        self._forget()
        raise EngineError(
            EngineErrorReason.RESTARTED,
            f"{what}: the engine restarted (incarnation {old[:8]} -> {str(incarnation)[:8]})"
            " since its buffers were attached",
        )

    def _forget(self) -> None:
        """Drop everything mapped from or promised by the attached engine process."""
        self._incarnation = None
        self._slots = []
        self._push = False
        self._arenas.clear()

    @property
    def mapped_arenas(self) -> int:
        """How many of the engine's staging arenas this process maps now."""
        return len(self._arenas)

    @property
    def copies_here(self) -> bool:
        """Whether buckets are copied into the engine's arenas by this process."""
        return self._push and self._channel is not None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _post(self, action: str, body: str, *, api: str = "update") -> dict[str, Any]:
        try:
            async with self._client().post(
                f"{self._base_url}/v1/{api}/{action}",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as response:
                payload = await response.text()
                if response.status == 200:
                    return _json(payload)
                if response.status == 409:
                    error = _json(payload)
                    raise EngineError(
                        str(error.get("reason", EngineErrorReason.REJECTED)),
                        str(error.get("message")),
                    )
                raise EngineError(
                    EngineErrorReason.HTTP_ERROR, f"{action}: HTTP {response.status}: {payload}"
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(EngineErrorReason.UNREACHABLE, f"{action}: {exc!r}") from exc

    async def _over_channel(
        self, what: str, call: Callable[[UpdateChannelClient], Awaitable[T]]
    ) -> T:
        channel = self._channel
        if channel is None:
            raise EngineError(EngineErrorReason.UNREACHABLE, f"{what}: no update channel")
        try:
            result = await asyncio.wait_for(call(channel), self._timeout_seconds)
        except TimeoutError as exc:
            raise EngineError(
                EngineErrorReason.TIMEOUT, f"{what}: no reply within {self._timeout_seconds:g} s"
            ) from exc
        except (OSError, ProtocolError) as exc:
            raise EngineError(EngineErrorReason.UNREACHABLE, f"{what}: {exc!r}") from exc
        if isinstance(result, Reply) and not result.ok:
            raise EngineError(result.reason or EngineErrorReason.REJECTED, result.message)
        return result

    async def attach_buffers(self, slots: Sequence[torch.Tensor], copies: int = 1) -> None:
        self._forget()
        handles = SlotHandles(slots=describe_slots(slots).slots, copies=copies)
        first = handles.copy_groups()[0]  # the receiving device's: the one copied from here
        reply = await self._post("attach", handles.model_dump_json())
        address = reply.get("update_channel") if self._use_channel else None
        if self._channel is not None:  # a new attach may be a new engine: connect anew
            await self._channel.close()
            self._channel = None
        if isinstance(address, str) and address:
            channel = UpdateChannelClient(address)
            try:
                await asyncio.wait_for(channel.connect(), self._timeout_seconds)
            except (OSError, TimeoutError) as exc:
                log.warning("update channel %s unreachable, using HTTP: %s", address, exc)
            else:
                self._channel = channel
        self._slots = list(slots[: len(first)])
        incarnation = reply.get("incarnation")
        self._incarnation = incarnation if isinstance(incarnation, str) else None
        self._push = self._channel is not None and reply.get("staging") == "shared"
        if self._channel is not None:
            how = "copied by the agent" if self._push else "copied by the engine"
            log.info("engine updates over %s, buckets %s", self._channel.address, how)

    async def begin_update(self, version: int) -> None:
        self._arenas.begin_round()
        if self._channel is not None:
            reply = await self._over_channel(
                "begin", lambda c: c.call(BeginRequest(version=version))
            )
            self._same_engine(reply.incarnation, "begin")
        else:
            body = await self._post("begin", _dumps({"version": version}))
            self._same_engine(body.get("incarnation"), "begin")

    async def load_bucket(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        if not 0 <= slot < len(self._slots):
            raise EngineError(
                EngineErrorReason.BAD_SLOT, f"slot {slot} not attached ({len(self._slots)} slots)"
            )
        if self.copies_here:
            staged = await self._stage(tensors, f"stage slot {slot}")
            arena = await self._arena(staged)
            if arena is not None:
                await self._copy(self._slots[slot], arena, staged.copies)
                return
        if self._channel is not None:
            await self._over_channel(f"load slot {slot}", lambda c: c.load(slot, tensors))
        else:
            await self._post("load", _dumps({"slot": slot, "tensors": rows(tensors)}))

    @property
    def stages_directly(self) -> bool:
        return self.copies_here

    async def begin_staged(
        self, version: int, buckets: Sequence[Sequence[TensorSlice]]
    ) -> list[list[torch.Tensor]]:
        if not self.copies_here:
            raise EngineError(EngineErrorReason.UNSUPPORTED, "the engine's arenas are not mapped")
        self._arenas.begin_round()
        for tensors in buckets:
            self._arenas.note_bucket(tensors)
        staged = await self._over_channel("begin", lambda c: c.begin(version, buckets))
        if not isinstance(staged, list):  # a refusal raised already
            raise EngineError(EngineErrorReason.BAD_REPLY, "begin answered without arenas")
        views = []
        for tensors, bucket in zip(buckets, staged, strict=True):
            self._same_engine(bucket.incarnation, "begin")
            if await self._arena(bucket) is None:  # the next round copies through the slots
                raise EngineError(
                    EngineErrorReason.UNSUPPORTED, "the engine's arena cannot be mapped here"
                )
            views.append(self._arenas.views(bucket.arena, bucket.copies, tensors))
        return views

    async def _stage(self, tensors: Sequence[TensorSlice], what: str) -> Staged:
        """Have the engine stage a bucket: the arena it goes to and where in it."""
        self._arenas.note_bucket(tensors)
        staged = await self._over_channel(what, lambda c: c.stage(tensors))
        if not isinstance(staged, Staged):  # a refusal raised already
            raise EngineError(EngineErrorReason.BAD_REPLY, "stage answered without an arena")
        self._same_engine(staged.incarnation, what)
        return staged

    async def _arena(self, staged: Staged) -> torch.Tensor | None:
        """The staged arena mapped here; None (and loads from now on) if it cannot be."""
        arena = self._arenas.get(staged.arena)
        if arena is None:
            handle = staged.handle
            if handle is None:  # we let its mapping go: ask again
                reply = await self._over_channel("handle", lambda c: c.handle(staged.arena))
                handle = reply.handle
            if handle is None:
                raise EngineError(
                    EngineErrorReason.BAD_REPLY, f"no handle for arena {staged.arena}"
                )
            try:
                arena = open_slots(SlotHandles(slots=[handle]))[0]
            except (SlotError, RuntimeError) as exc:
                log.warning("cannot map the engine's arenas, the engine copies instead: %s", exc)
                self._push = False
                return None
            self._arenas.add(staged.arena, arena)
        return arena

    async def _copy(
        self, source: torch.Tensor, arena: torch.Tensor, copies: list[tuple[int, int, int]]
    ) -> None:
        for start, at, nbytes in copies:
            if start < 0 or start + nbytes > source.numel() or at + nbytes > arena.numel():
                raise EngineError(
                    EngineErrorReason.BAD_BUCKET, f"copy [{start}, +{nbytes}) does not fit"
                )
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="ref-adapter-copy")
        stream = None
        if source.is_cuda:
            stream = self._streams.get(source.device)
            if stream is None:
                stream = self._streams[source.device] = torch.cuda.Stream(source.device)  # type: ignore[no-untyped-call]
        loop = asyncio.get_running_loop()
        # A cancelled wait leaves the copy to finish on the stream; the next copy into
        # this arena is queued behind it on the same stream, so it never lands late.
        await loop.run_in_executor(self._copier, partial(copy_spans, source, arena, copies, stream))

    def copies_event(self, device: torch.device) -> torch.cuda.Event | None:
        usable = self.copies_here and self._events.usable and device.type == "cuda"
        return self._events.get(device) if usable else None

    async def finish_staged(self, version: int, copies: torch.cuda.Event) -> None:
        try:
            await self.finish_update(version, event_handle(copies))
        except EngineError as exc:
            if exc.reason not in (EngineErrorReason.UNSUPPORTED, "bad_request"):  # its words
                raise
            # It cannot open the event (it committed nothing): wait here, from now on too.
            log.warning("the engine cannot wait for the copies' event: %s", exc)
            self._events.usable = False
            await asyncio.to_thread(copies.synchronize)
            await self.finish_update(version)

    async def finish_update(self, version: int, after: str | None = None) -> None:
        if self._channel is not None or after is not None:  # only the channel awaits `after`
            request = FinishRequest(version=version, after=after)
            reply = await self._over_channel("finish", lambda c: c.call(request))
            self._same_engine(reply.incarnation, "finish")
        else:
            body = await self._post("finish", _dumps({"version": version}))
            self._same_engine(body.get("incarnation"), "finish")
        self._arenas.forget_unused()

    async def abort_update(self, version: int, reason: str) -> None:
        if self._channel is not None:
            request = AbortRequest(version=version, reason=reason)
            await self._over_channel("abort", lambda c: c.call(request))
        else:
            await self._post("abort", _dumps({"version": version, "reason": reason}))
        self._arenas.forget_unused()  # rounds that keep failing must not keep old arenas

    async def release_memory(self, tags: frozenset[MemoryTag]) -> frozenset[MemoryTag]:
        if not tags:
            return tags
        reply = await self._post("release", _dumps({"tags": sorted(tags)}), api="memory")
        self._same_engine(reply.get("incarnation"), "release")
        if MemoryTag.WEIGHTS in tags:  # unmap every arena, or the release frees nothing
            self._arenas.forget_all()
        return frozenset(MemoryTag(tag) for tag in reply.get("released", ()))

    async def resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        if not tags:
            return
        reply = await self._post("resume", _dumps({"tags": sorted(tags)}), api="memory")
        self._same_engine(reply.get("incarnation"), "resume")

    async def health(self) -> EngineHealth:
        try:
            async with self._client().get(f"{self._base_url}/health") as response:
                if response.status != 200:
                    return EngineHealth(False, None, detail=f"HTTP {response.status}")
                body = await response.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return EngineHealth(False, None, detail=f"unreachable: {exc!r}")
        incarnation = body.get("incarnation")
        return EngineHealth(
            healthy=bool(body["healthy"]),
            version=body["version"],
            torn=bool(body.get("torn", False)),
            detail=str(body.get("detail", "")),
            incarnation=incarnation if isinstance(incarnation, str) else None,
            released=frozenset(MemoryTag(tag) for tag in body.get("released", ())),
        )

    async def released_memory(self) -> frozenset[MemoryTag] | None:
        health = await self.health()
        if health.incarnation is None:  # unreachable, or no /health of its own
            raise EngineError(EngineErrorReason.UNREACHABLE, f"reference engine: {health.detail}")
        return health.released

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        self._arenas.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None


def _dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))


def _json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {"message": text}
    return value if isinstance(value, dict) else {"message": text}
