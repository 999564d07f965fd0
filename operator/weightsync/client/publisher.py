"""`Publisher`: what a trainer calls after `optimizer.step()`.

    from weightsync.client import Publisher
    publisher = Publisher()
    result = publisher.publish(model.named_parameters(), version=step)

The first publish sends the tensor metadata; the agent plans the bucket layout.
* On GPU the tensors themselves are shared once (CUDA IPC); the agent packs each bucket
  in its own process, on the stream that broadcasts it, and a publish is one request
  and its result. The Publisher synchronises the device first, and the agent is done
  reading the tensors when `publish` returns; tensors that moved are shared again.
* Otherwise (CPU, or tensors the agent cannot map) the agent answers with its bucket
  slots (shared memory, or CUDA IPC), which this process maps once, and every publish
  copies bucket after bucket into the slots the agent names, in step with its broadcast.
Only small JSON messages cross the socket. A different tensor set (or new bucket
settings from the operator) renegotiates.

A sharded trainer calls `publish` on every source rank with its `DTensor`s (FSDP2, tensor
or expert parallel) or the plain tensors that rank owns: each rank sends only what it
holds locally (`client.shards`), and packs its own pieces when its agent asks.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from weightsync.api import agent_env
from weightsync.client.inputs import Accepted, PublishInputError, checked_tensors
from weightsync.client.shards import ShardError, describe, is_sharded
from weightsync.transfer.buffers import (
    copy_tensors,
    describe_sources,
    dtype_name,
    open_slots,
    slot_views,
)
from weightsync.transfer.handoff import (
    Abandon,
    Attach,
    Attached,
    Boxes,
    Fill,
    Filled,
    HandoffError,
    Message,
    ProtocolError,
    Publish,
    PublishResult,
    recv_message,
    send_message,
)
from weightsync.transfer.layout import BucketLayout, TensorMeta, plan_layout

log = logging.getLogger(__name__)


_NOT_YET = frozenset({"no_plan"})


class PublisherError(RuntimeError):
    """The publish could not even start or complete its exchange with the agent."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class AgentUnavailableError(PublisherError):
    """The source agent's socket is missing, refused, or closed mid-exchange."""


class LayoutChangedError(PublisherError):
    """The agent no longer accepts this layout and renegotiation did not settle it."""


@dataclass(frozen=True, slots=True)
class _Described:
    metas: list[TensorMeta]  # the global tensors
    boxes: Boxes | None  # None: every tensor held whole
    local: dict[str, torch.Tensor]  # this rank's bytes of each tensor it holds
    signature: list[object]


@dataclass(frozen=True, slots=True)
class _Kept:
    """The last tensors accepted and how they were described: the same again skip both."""

    accepted: Accepted
    metas: list[TensorMeta]
    signature: list[object]


@dataclass(frozen=True, slots=True)
class PublishTimings:
    """Where the last `publish()` spent its time in the trainer's process, in seconds."""

    total: float
    pack: float  # copying buckets into the agent's slots, each until its copy completed
    longest_pack: float
    buckets: int
    # Until the Publish message went out: input checks and the tensor set's description
    # (Python work per tensor), then `sync`, waiting for the trainer's queued GPU work.
    prepare: float = 0.0
    sync: float = 0.0

    @property
    def waiting(self) -> float:
        """Time spent waiting on the agent (broadcast, engines, votes) rather than packing."""
        return self.total - self.pack


def agent_socket(environ: Mapping[str, str]) -> str:
    """The injected agent's socket: `WEIGHTSYNC_SOCKET`; in a trainer pod of several ranks
    a template that this rank's `LOCAL_RANK` (as torchrun sets it) completes."""
    path = environ.get(agent_env.SOCKET) or agent_env.SOCKET_PATH
    if agent_env.LOCAL_RANK_PLACEHOLDER not in path:
        return path
    local = environ.get("LOCAL_RANK", "")
    if not local.isdigit():
        raise PublisherError(
            "no_local_rank",
            f"this trainer pod runs several ranks ({agent_env.SOCKET}={path}): set LOCAL_RANK"
            " to this process's local rank, as torchrun does",
        )
    return path.replace(agent_env.LOCAL_RANK_PLACEHOLDER, local)


class Publisher:
    """A connection to the local source agent; not thread-safe (one trainer rank, one)."""

    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, *, timeout: float = 600.0
    ) -> None:
        self.socket_path = Path(socket_path or agent_socket(os.environ))
        self.timeout = timeout
        # Versions rise within one Publisher; a new one (a trainer restarted from an
        # earlier step) is a new lineage, which engines follow from wherever it starts.
        self.lineage = uuid.uuid4().hex[:16]
        self.last_published: int | None = None  # the last version that reached every engine
        self._sock: socket.socket | None = None
        self._metas: list[TensorMeta] | None = None
        self._layout: BucketLayout | None = None
        self._slots: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        # Sharded: per (slot, bucket), the pieces the agent asked for and their slot views.
        self._piece_views: dict[tuple[int, int], tuple[list[tuple[str, int]], list[torch.Tensor]]]
        self._piece_views = {}
        self._signature: list[object] = []
        self._boxes: Boxes | None = None  # sharded: what this rank holds, as attached
        # Set when the agent packs from our tensors (GPU): where they lay when shared, and
        # their devices (the same while the addresses are: a moved tensor has a new one).
        self._shared_at: list[int] | None = None
        self._devices: set[torch.device] = set()
        self._kept: _Kept | None = None  # not for sharded sets: described every call
        self._packed: list[float] = []
        self._sent_at, self._synced = 0.0, 0.0  # this call's Publish message, its GPU wait
        self.last_timings: PublishTimings | None = None

    # ------------------------------------------------------------------ public
    def publish(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
    ) -> PublishResult:
        """Send `named_tensors` as weight version `version` to every engine of the group.

        Raises `PublishInputError` (before anything is sent) for input that cannot be
        published: a name twice, a value that is not a tensor, an unsupported dtype, a
        version that is not a non-negative integer above the last published one.
        """
        started = time.perf_counter()
        self._packed = []
        self._sent_at, self._synced = started, 0.0
        version = self._checked_version(version)
        kept = self._kept
        tensors, again = checked_tensors(named_tensors, kept.accepted if kept else None)
        if not again:
            self._kept = None
        try:
            result = self._publish(tensors, version)
        except PublisherError:
            raise
        except BaseException:
            self.close()  # the agent may be mid-exchange: start the next call afresh
            raise
        finally:
            self.last_timings = PublishTimings(
                total=time.perf_counter() - started,
                pack=sum(self._packed),
                longest_pack=max(self._packed, default=0.0),
                buckets=len(self._packed),
                prepare=self._sent_at - started,
                sync=self._synced,
            )
        if result.ok:
            self.last_published = result.version
        return result

    def _checked_version(self, version: object) -> int:
        if isinstance(version, bool) or not isinstance(version, int):
            raise PublishInputError(
                f"version: must be an int (a step number), got {type(version).__name__} {version!r}"
            )
        if version < 0:
            raise PublishInputError(f"version: must be >= 0, got {version}")
        last = self.last_published
        if last is not None and version <= last:
            raise PublishInputError(
                f"version: must be above {last}, the last this Publisher published, got"
                f" {version} (a trainer that restarts from an earlier step makes a new"
                " Publisher: a new lineage)"
            )
        return version

    def _described(self, tensors: dict[str, torch.Tensor]) -> _Described:
        """The tensor set as this rank publishes it; metadata is rebuilt only when names,
        shapes, dtypes or held blocks changed (then the Publisher attaches again)."""
        if not is_sharded(tensors.values()):
            signature: list[object] = [(name, t.shape, t.dtype) for name, t in tensors.items()]
            if self._metas is not None and signature == self._signature and self._boxes is None:
                return _Described(self._metas, None, tensors, signature)
            metas = [TensorMeta(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()]
            return _Described(metas, None, tensors, signature)
        try:
            pieces = [describe(name, t) for name, t in tensors.items()]
        except ShardError as exc:  # nothing was sent: the Publisher stays usable
            raise PublishInputError(str(exc)) from None
        boxes: Boxes = [(list(p.box.offset), list(p.box.shape)) if p.box else None for p in pieces]
        local = {p.meta.name: p.local for p in pieces if p.local is not None}
        signature = [(p.meta, p.box) for p in pieces]
        if self._metas is not None and signature == self._signature:
            return _Described(self._metas, self._boxes, local, signature)
        return _Described([p.meta for p in pieces], boxes, local, signature)

    def _publish(self, tensors: dict[str, torch.Tensor], version: int) -> PublishResult:
        kept = self._kept
        if kept is not None:  # the tensors accepted last time, unchanged
            described = _Described(kept.metas, None, tensors, kept.signature)
            addresses = kept.accepted.addresses
        else:
            described = self._described(tensors)
            addresses = _addresses(described.local)
            if described.boxes is None:
                self._kept = _Kept(Accepted.of(tensors), described.metas, described.signature)
        local = described.local
        if self._shared_at is not None and self._shared_at != addresses:
            self._layout = None  # the tensors moved: share them again
        for attempt in range(2):
            if self._layout is None or described.metas is not self._metas:
                try:
                    self._attach(described.metas, local, described.boxes)
                    self._signature = described.signature
                except PublisherError as exc:
                    if exc.reason not in _NOT_YET:
                        raise
                    # The operator has not planned the group yet: a failed round, not a bug.
                    return PublishResult(
                        version=version,
                        ok=False,
                        duration_seconds=0.0,
                        bytes=0,
                        reason=exc.reason,
                        message=str(exc),
                    )
            result = self._round(local, version)
            if result.reason != "layout_mismatch":
                return result
            log.info("agent asked to renegotiate the layout (attempt %d)", attempt + 1)
            self._layout = None
        raise LayoutChangedError("layout_mismatch", "the agent rejected the layout twice")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol
    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.socket_path))
            except OSError as exc:
                sock.close()
                raise AgentUnavailableError(
                    "agent_unavailable", f"no weightsync agent at {self.socket_path}: {exc}"
                ) from exc
            self._sock = sock
        return self._sock

    def _exchange(self, message: Attach | Publish | Filled | Abandon | None) -> Message:
        sock = self._connect()
        try:
            if message is not None:
                send_message(sock, message)
            return recv_message(sock)
        except (OSError, ProtocolError) as exc:
            self.close()
            self._layout = None  # a restarted agent has new slots
            raise AgentUnavailableError(
                "agent_gone", f"the weightsync agent went away: {exc}"
            ) from exc

    def _attach(
        self,
        metas: list[TensorMeta],
        tensors: dict[str, torch.Tensor],
        boxes: Boxes | None,
    ) -> None:
        # A sharded rank packs its own pieces (the agent maps whole tensors only).
        sources = None if boxes else describe_sources([tensors[m.name] for m in metas])
        names = [(m.name, list(m.shape), m.dtype) for m in metas]
        reply = self._exchange(Attach(tensors=names, sources=sources, boxes=boxes))
        if isinstance(reply, HandoffError):
            raise PublisherError(reply.reason, reply.message)
        if not isinstance(reply, Attached):
            raise PublisherError("protocol", f"expected Attached, got {reply.type}")
        layout = plan_layout(metas, reply.bucket_size_bytes, reply.alignment)
        if layout.layout_hash != reply.layout_hash:
            raise LayoutChangedError("layout_hash_mismatch", "the agent planned another layout")
        self._shared_at = _addresses(tensors) if reply.agent_packs else None
        self._devices = {t.device for t in tensors.values()} if reply.agent_packs else set()
        self._slots = [] if reply.agent_packs else open_slots(reply.slots)
        self._views.clear()
        self._piece_views.clear()
        self._metas, self._layout, self._boxes = metas, layout, boxes

    def _round(self, tensors: dict[str, torch.Tensor], version: int) -> PublishResult:
        layout = self._layout
        if layout is None:
            raise PublisherError("protocol", "publish before attach")
        if self._shared_at is not None:  # the agent reads the tensors: they must be written
            synced = time.perf_counter()
            for device in self._devices:
                torch.cuda.synchronize(device)
            self._synced = time.perf_counter() - synced
        self._sent_at = time.perf_counter()
        message = self._exchange(
            Publish(version=version, lineage=self.lineage, layout_hash=layout.layout_hash)
        )
        while True:
            if isinstance(message, PublishResult):
                return message
            if isinstance(message, HandoffError):
                raise PublisherError(message.reason, message.message)
            if not isinstance(message, Fill):
                raise PublisherError("protocol", f"unexpected {message.type} during a round")
            try:
                self._fill(layout, tensors, message)
            except Exception as exc:  # the agent still drives the round to its end
                log.exception("filling bucket %d failed", message.bucket)
                message = self._exchange(Abandon(reason="fill_failed", message=repr(exc)))
                continue
            message = self._exchange(Filled(bucket=message.bucket))

    @torch.no_grad()
    def _fill(self, layout: BucketLayout, tensors: dict[str, torch.Tensor], fill: Fill) -> None:
        started = time.perf_counter()
        if fill.slots is not None:  # the agent grew its slots for this round's layout
            self._slots = open_slots(fill.slots)
            self._views.clear()
            self._piece_views.clear()
        slot = self._slots[fill.slot]
        if fill.pieces is not None:  # sharded: this rank's blocks, where the agent says
            names = [name for name, _ in fill.pieces]
            key = (fill.slot, fill.bucket)
            known = self._piece_views.get(key)
            if known is None or known[0] != fill.pieces:  # built once: the same every round
                views = [
                    slot[offset : offset + tensors[name].nbytes]
                    .view(tensors[name].dtype)
                    .view(tensors[name].shape)
                    for name, offset in fill.pieces
                ]
                self._piece_views[key] = (fill.pieces, views)
            else:
                views = known[1]
        else:
            bucket = layout.buckets[fill.bucket]
            names = [t.name for t in bucket.tensors]
            key = (fill.slot, fill.bucket)
            if key not in self._views:
                self._views[key] = slot_views(slot, bucket.tensors)
            views = self._views[key]
        # On the current stream, after whatever the trainer queued that writes the tensors.
        copy_tensors(views, [tensors[name] for name in names])
        if slot.is_cuda:  # the agent broadcasts from another process: the copy must be done
            torch.cuda.current_stream(slot.device).synchronize()
        self._packed.append(time.perf_counter() - started)


def _addresses(tensors: dict[str, torch.Tensor]) -> list[int]:
    return list(map(torch.Tensor.data_ptr, tensors.values()))
