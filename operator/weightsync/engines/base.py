"""The contract between a sink agent and the inference engine it feeds.

A sink agent owns its bucket buffers (GPU memory on GPU, shared memory on CPU). It
attaches them to the engine adapter once; after that, per bucket, only metadata
(`TensorSlice`s) moves. `load_bucket` returns only once the engine no longer needs
the slot, so the agent may reuse it for bucket k+2 (double buffering).

An update is all-or-nothing from the operator's point of view: after
`begin_update(v)` the engine either reaches `finish_update(v)` and serves v, or
`abort_update(v, reason)` leaves it serving its previous version (engines that
stage) or reporting itself `torn` (engines that load in place) until a later
version or a recovery repairs it. It never silently serves a mix.

Memory between rounds (Colocated mode): `release_memory(tags)` frees at least `tags` while
the trainer trains and answers what it freed (vLLM's sleep at level 1 frees the KV cache
and moves the weights to host memory: both leave the GPU); `resume_memory(tags)` brings
them back. The agent wakes weights before a round's loads and the KV cache after its
commit. An engine whose weights were released refuses inference until a round commits.
`released_memory()` reads what the engine has released (vLLM `GET /is_sleeping`, the
reference engine's `/health`); SGLang 0.5.23 exposes no such state (its scheduler's
`offload_tags` is in no route), so its adapter cannot say.

Engine incarnations: an engine process can die and come back at the same address (a
kubelet restarts a crashed container in place). Every adapter learns an identity of the
process it talks to, `EngineHealth.incarnation` (a start time, a server id, or one the
adapter plants), records the incarnation it attached its buffers to, and checks it
before and after every round. When it changed, the adapter drops everything it mapped
or cached from the older one and raises `EngineError("restarted", ...)`: the new
process serves whatever it loaded at start, so it is behind whatever it reports, until
a round or a recovery brings it to the current version.

The reference engine names its incarnation. The SGLang and vLLM adapters name none
(neither server exposes a process identity by default): a restarted server answers its
start-up `weight_version` ("default", as the recordings the replay test holds to the
real servers show), which reads as no weightsync version, so the watch stops vouching
for it at once. Those adapters map nothing of the engine's (the reference adapter maps
the engine's staging arenas; these hand the engine a handle, a shared-memory path or a
payload with each call), so there is nothing of an older process to drop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from weightsync.api.reasons import EngineErrorReason

if TYPE_CHECKING:
    import torch

    from weightsync.api.engines import EngineOptions, MemoryTag
    from weightsync.transfer.layout import TensorSlice


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """What an engine says about itself; the operator gates readiness on it."""

    healthy: bool
    version: int | None  # the weight version it serves; None before the first
    torn: bool = False  # an aborted in-place update left it inconsistent
    detail: str = ""
    # Identity of the engine process; a new value means it restarted. None: unknown
    # (unreachable), never "unchanged".
    incarnation: str | None = None
    # What it has released between Colocated rounds and not woken yet, as it says itself.
    released: frozenset[MemoryTag] = frozenset()


class EngineError(RuntimeError):
    """The engine refused or failed a request; `reason` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineAdapter(abc.ABC):
    """How a sink agent applies weights to one engine. One instance per engine."""

    @classmethod
    @abc.abstractmethod
    def for_engine(cls, base_url: str, options: EngineOptions | None = None) -> Self:
        """The adapter for the engine at `base_url` with a WeightSync entry's options.

        The one way an agent (and the engine contract tests) builds any adapter; an
        adapter whose engine has no such options ignores them.
        """

    @abc.abstractmethod
    async def attach_buffers(self, slots: Sequence[torch.Tensor], copies: int = 1) -> None:
        """Share the agent's bucket slots with the engine once (IPC handles, shm names).

        An engine on several devices (tensor parallel) reads a copy of each slot on each:
        `slots` is then `copies` groups of equal length, one per device, each in slot
        order, and slot index i names the i-th slot of every group. GPU copies are told
        apart by their GPU, CPU copies (shared memory) by their group's position.
        """

    @property
    def attached_to(self) -> str | None:
        """The incarnation the slots were last attached to; None before an attach, after a
        restart was seen, or for an engine that names no incarnation."""
        return None

    @abc.abstractmethod
    async def begin_update(self, version: int) -> None:
        """Prepare for version `version` (pause generation if the engine needs it)."""

    @abc.abstractmethod
    async def load_bucket(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        """Apply the tensors now in slot `slot`; return when the slot may be reused."""

    @property
    def stages_directly(self) -> bool:
        """Whether `begin_staged` hands out the engine's own staging memory now (Colocated:
        the source agent then packs the trainer's tensors straight into it, one copy)."""
        return False

    async def begin_staged(
        self, version: int, buckets: Sequence[Sequence[TensorSlice]]
    ) -> list[list[torch.Tensor]]:
        """`begin_update(version)` and stage every one of `buckets` with it: for each, a
        view of the engine's own memory per tensor, in order, for the caller to write
        (instead of `load_bucket`). The buckets count as loaded; the caller completes
        every write before `finish_update`. Only while `stages_directly`."""
        raise EngineError(
            EngineErrorReason.UNSUPPORTED, f"{type(self).__name__} takes buckets from slots only"
        )

    def copies_event(self, device: torch.device) -> torch.cuda.Event | None:
        """An interprocess CUDA event on `device` for `finish_staged`, or None when the
        engine cannot wait for one (then wait for the writes before `finish_update`)."""
        return None

    async def finish_staged(self, version: int, copies: torch.cuda.Event) -> None:
        """`finish_update` of a `begin_staged` update whose writes may still run on the
        GPU: the engine commits once `copies` (`copies_event`, recorded after them)
        completed, so the request travels while the copies end."""
        raise EngineError(
            EngineErrorReason.UNSUPPORTED, f"{type(self).__name__} waits for no CUDA event"
        )

    @abc.abstractmethod
    async def finish_update(self, version: int) -> None:
        """Make `version` the served version (set weight version, resume generation)."""

    @abc.abstractmethod
    async def abort_update(self, version: int, reason: str) -> None:
        """Give up on `version`; resume serving and say whether the engine is torn."""

    @abc.abstractmethod
    async def health(self) -> EngineHealth:
        """The engine's health and served version."""

    async def release_memory(self, tags: frozenset[MemoryTag]) -> frozenset[MemoryTag]:
        """Free `tags` (and perhaps more) between rounds; return every tag freed. No tags:
        nothing is asked of the engine (as for `resume_memory`)."""
        raise EngineError(
            EngineErrorReason.UNSUPPORTED, f"{type(self).__name__} cannot release memory"
        )

    async def resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        """Allocate `tags` again (weights with undefined contents until a round loads)."""
        raise EngineError(
            EngineErrorReason.UNSUPPORTED, f"{type(self).__name__} cannot resume memory"
        )

    async def released_memory(self) -> frozenset[MemoryTag] | None:
        """What the engine has released and not woken, as the engine itself says, adopted
        as this adapter's own view (an agent restarted while its engine sleeps learns it
        here, so its next round wakes the engine in order). None: the engine does not say
        (nothing is adopted). An engine that cannot release has released nothing."""
        return frozenset()

    async def close(self) -> None:  # noqa: B027 - most adapters hold nothing to release
        """Release connections; the engine keeps running."""
