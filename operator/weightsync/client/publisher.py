"""`Publisher`: what a trainer calls after `optimizer.step()`.

    from weightsync.client import Publisher
    publisher = Publisher()
    result = publisher.publish(model.named_parameters(), version=step)

In Colocated mode with `spec.colocated.memoryRelease`, call `publisher.release()` before
training: the engine frees its KV cache (and weights), and `publish` wakes it again.

The first publish sends the tensor metadata; the agent plans the bucket layout (call
`publisher.attach(model.named_parameters())` at start-up to do it before the first step).
* On GPU the tensors themselves are shared once (CUDA IPC); the agent packs each bucket
  in its own process, on the stream that broadcasts it, and a publish is one request
  and its result. The Publisher synchronises the device first; tensors that moved are
  shared again. `publish` returns once every engine serves the version; where the agent
  also holds it for recovery, its copy of the tensors to host memory may still run
  (about 0.3 s for 16 GB): call `fence()` before writing them, or once
  `publisher.guard(optimizer)`, which fences before every optimizer step. Without a
  fence the next `publish` finds the tensors written (their version counters moved),
  the agent drops that copy, and from then on `publish` waits for the copy itself.
* Otherwise (CPU, or tensors the agent cannot map) the agent answers with its bucket
  slots (shared memory, or CUDA IPC), which this process maps once, and every publish
  copies bucket after bucket into the slots the agent names, in step with its broadcast.
Only small JSON messages cross the socket. A different tensor set (or new bucket
settings from the operator) renegotiates.

A sharded trainer calls `publish` on every source rank with its `DTensor`s (FSDP2, tensor
or expert parallel) or the plain tensors that rank owns: each rank sends only what it
holds locally (`client.shards`): on GPU its agent maps those blocks and packs the
rank's pieces of each bucket itself, elsewhere this process packs them when asked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.hooks import RemovableHandle

from weightsync.api.reasons import FailureReason
from weightsync.client.connection import (
    AgentUnavailableError,
    LayoutChangedError,
    PublisherError,
    agent_socket,
    connect,
)
from weightsync.client.filling import PublishTimings, SlotFiller
from weightsync.client.inputs import (
    Described,
    Kept,
    checked_tensors,
    checked_version,
    describe_tensors,
    kept_of,
    tensor_addresses,
)
from weightsync.transfer.buffers import describe_sources
from weightsync.transfer.handoff import (
    Abandon,
    Attach,
    Attached,
    Boxes,
    Fence,
    Fenced,
    Fill,
    Filled,
    HandoffError,
    Message,
    ProtocolError,
    Publish,
    PublishResult,
    Release,
    Released,
    recv_message,
    send_message,
)
from weightsync.transfer.layout import BucketLayout, TensorMeta, plan_layout

log = logging.getLogger(__name__)


_NOT_YET = frozenset({FailureReason.NO_PLAN})


@dataclass(frozen=True, slots=True)
class _Hold:
    """A round whose tensors the agent's holder copy may still read, and the tensors'
    version counters when it ended (an in-place write moves them)."""

    version: int
    tensors: list[torch.Tensor]
    counters: list[int]


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
        self._filler = SlotFiller()
        self._signature: list[object] = []
        self._boxes: Boxes | None = None  # sharded: what this rank holds, as attached
        # Set when the agent packs from our tensors (GPU): where they lay when shared, and
        # their devices (the same while the addresses are: a moved tensor has a new one).
        self._shared_at: list[int] | None = None
        self._devices: set[torch.device] = set()
        self._kept: Kept | None = None  # the last call's tensors and their description
        self._sent_at, self._synced = 0.0, 0.0  # this call's Publish message, its GPU wait
        self._fenced = 0.0  # this call's wait in `fence`
        self._hold: _Hold | None = None
        # Set once the trainer wrote published tensors before fencing: from then on each
        # publish waits for the holder's copy itself.
        self.fence_in_publish = False
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
        self._filler.packed = []
        self._sent_at, self._synced, self._fenced = started, 0.0, 0.0
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
                pack=sum(self._filler.packed),
                longest_pack=max(self._filler.packed, default=0.0),
                buckets=len(self._filler.packed),
                prepare=self._sent_at - started,
                sync=self._synced,
                fence=self._fenced,
            )
        if result.ok:
            self.last_published = result.version
        return result

    def attach(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> bool:
        """Share the tensors `publish()` will send with the agent now, off the first
        round's path: the agent maps them, plans the buckets and starts allocating its
        holder's host memory. Optional (`publish()` attaches when it must); call it once
        the model is on its devices. False when the operator has not planned the group
        yet: `publish()` attaches then. Input errors as `publish()`'s."""
        tensors, _ = checked_tensors(named_tensors)
        described = self._described(tensors)
        try:
            self._attach(described.metas, described.local, described.boxes)
        except PublisherError as exc:
            if exc.reason not in _NOT_YET:
                raise
            return False
        self._signature, self._kept = described.signature, kept_of(tensors, described)
        return True

    def fence(self) -> bool:
        """Wait until the agent no longer reads the tensors of the last publish, before
        the trainer writes them; True when the agent holds that version for recovery.
        Cheap when nothing is pending (every call but the one after a holding round)."""
        hold, self._hold = self._hold, None
        if hold is None:
            return False
        started = time.perf_counter()
        clean = [t._version for t in hold.tensors] == hold.counters
        if not clean and not self.fence_in_publish:
            log.warning(
                "the tensors of version %d were written before fence(): the agent does not"
                " hold it, and from now on publish() waits for the agent's copy; call"
                " publisher.guard(optimizer) (or fence() before writing) to avoid the wait",
                hold.version,
            )
            self.fence_in_publish = True
        try:
            reply = self._exchange(Fence(version=hold.version, clean=clean))
        finally:
            self._fenced += time.perf_counter() - started
        if isinstance(reply, HandoffError):
            raise PublisherError(reply.reason, reply.message)
        if not isinstance(reply, Fenced):
            raise PublisherError(FailureReason.PROTOCOL, f"expected Fenced, got {reply.type}")
        return reply.held

    def release(self) -> list[str]:
        """Free the Colocated engine's memory before the trainer trains, as the WeightSync's
        `colocated.memoryRelease` says (None: nothing), and return what the engine has
        released. The next `publish()` wakes it: the weights, the sync, then the KV cache.
        Raises `PublisherError` with the engine's refusal (`engine_release_failed`)."""
        reply = self._exchange(Release())
        if isinstance(reply, HandoffError):
            raise PublisherError(reply.reason, reply.message)
        if not isinstance(reply, Released):
            raise PublisherError(FailureReason.PROTOCOL, f"expected Released, got {reply.type}")
        return reply.tags

    def guard(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Fence before every `optimizer.step()`; the hook's handle (`.remove()`)."""

        def before_step(*_: object) -> None:
            self.fence()

        return optimizer.register_step_pre_hook(before_step)

    def _checked_version(self, version: object) -> int:
        return checked_version(version, self.last_published)

    def _described(self, tensors: dict[str, torch.Tensor]) -> Described:
        """The tensor set as this rank publishes it (`inputs.describe_tensors`)."""
        return describe_tensors(tensors, self._metas, self._signature, self._boxes)

    def _publish(self, tensors: dict[str, torch.Tensor], version: int) -> PublishResult:
        self.fence()  # the last round's copy, if the trainer did not fence
        kept = self._kept
        if kept is not None:  # the tensors accepted last time, unchanged
            described = kept.described(tensors)
            whole = kept.local is None
            addresses = kept.accepted.addresses if whole else tensor_addresses(described.local)
        else:
            described = self._described(tensors)
            addresses = tensor_addresses(described.local)
            self._kept = kept_of(tensors, described)
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
            if result.holding:
                held = list(local.values())
                self._hold = _Hold(result.version, held, [t._version for t in held])
                if self.fence_in_publish:
                    self.fence()
            if result.reason != FailureReason.LAYOUT_MISMATCH:
                return result
            log.info("agent asked to renegotiate the layout (attempt %d)", attempt + 1)
            self._layout = None
        raise LayoutChangedError(
            FailureReason.LAYOUT_MISMATCH, "the agent rejected the layout twice"
        )

    def close(self) -> None:
        if self._hold is not None and self._sock is not None:
            with contextlib.suppress(PublisherError):
                self.fence()  # the agent may keep the last copy
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol
    def _exchange(
        self, message: Attach | Publish | Filled | Abandon | Fence | Release | None
    ) -> Message:
        if self._sock is None:
            self._sock = connect(self.socket_path, self.timeout)
        sock = self._sock
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
        # What this rank holds, for the agent to map and pack from on its GPU: every
        # tensor whole, or a sharded rank's blocks (`tensors` holds those, in `metas`
        # order). Where it cannot map them, it asks for each bucket (Fill).
        held = list(tensors.values()) if boxes else [tensors[m.name] for m in metas]
        sources = describe_sources(held)
        names = [(m.name, list(m.shape), m.dtype) for m in metas]
        reply = self._exchange(Attach(tensors=names, sources=sources, boxes=boxes))
        if isinstance(reply, HandoffError):
            raise PublisherError(reply.reason, reply.message)
        if not isinstance(reply, Attached):
            raise PublisherError(FailureReason.PROTOCOL, f"expected Attached, got {reply.type}")
        layout = plan_layout(metas, reply.bucket_size_bytes, reply.alignment)
        if layout.layout_hash != reply.layout_hash:
            raise LayoutChangedError(
                FailureReason.LAYOUT_HASH_MISMATCH, "the agent planned another layout"
            )
        self._shared_at = tensor_addresses(tensors) if reply.agent_packs else None
        self._devices = {t.device for t in tensors.values()} if reply.agent_packs else set()
        self._filler.open(None if reply.agent_packs else reply.slots)
        self._metas, self._layout, self._boxes = metas, layout, boxes

    def _round(self, tensors: dict[str, torch.Tensor], version: int) -> PublishResult:
        layout = self._layout
        if layout is None:
            raise PublisherError(FailureReason.PROTOCOL, "publish before attach")
        if self._shared_at is not None:  # the agent reads the tensors: they must be written
            synced = time.perf_counter()
            for device in self._devices:
                if device.type == "cuda":
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
                raise PublisherError(
                    FailureReason.PROTOCOL, f"unexpected {message.type} during a round"
                )
            try:
                self._filler.fill(layout, tensors, message)
            except Exception as exc:  # the agent still drives the round to its end
                log.exception("filling bucket %d failed", message.bucket)
                message = self._exchange(
                    Abandon(reason=FailureReason.FILL_FAILED, message=repr(exc))
                )
                continue
            message = self._exchange(Filled(bucket=message.bucket))
