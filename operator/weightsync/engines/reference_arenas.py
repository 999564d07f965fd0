"""The reference engine's staging arenas as an agent maps them: which it maps, which
rounds used them, and the views a direct round writes into (`begin_staged`).

The engine frees an arena only once no process maps it (CUDA IPC keeps an exported
block alive while it is open), so the adapter lets go of what rounds no longer use: an
old layout's arenas as soon as a bucket of a new layout is staged (without this a GPU
engine changing bucket size needs three copies of the model at once), arenas no round
used lately, and every arena when the engine's weights are released.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import torch

from weightsync.engines.reference_channel import arena_views
from weightsync.transfer.layout import TensorSlice

BucketKey = tuple[object, ...]


def bucket_key(tensors: Sequence[TensorSlice]) -> BucketKey:
    """A bucket's identity for telling layouts apart, in constant time: where it starts
    and ends in the slot, and with which tensors."""
    first, last = tensors[0], tensors[-1]
    return (len(tensors), first.name, first.offset, last.name, last.offset + last.nbytes)


class MappedArenas:
    def __init__(self) -> None:
        self._bytes: dict[int, torch.Tensor] = {}  # arena id -> its bytes, mapped here
        self._used: dict[int, int] = {}  # arena id -> the last round that used it
        # Arena id -> its bucket's tensors as views (an arena holds one bucket's plan).
        self._views: dict[int, list[torch.Tensor]] = {}
        self.rounds = 0
        # The buckets of the layout being sent: a bucket not among them starts a new
        # layout, whose arenas the engine allocates anew.
        self._layout: set[BucketKey] = set()
        self._this_round: set[BucketKey] = set()

    def __len__(self) -> int:
        return len(self._bytes)

    def begin_round(self) -> None:
        self.rounds += 1
        self._this_round = set()

    def note_bucket(self, tensors: Sequence[TensorSlice]) -> None:
        """Before a bucket is staged: if it is of a new layout, let go of every arena this
        round has not used (the old layout's)."""
        if not tensors:
            return
        key = bucket_key(tensors)
        self._this_round.add(key)
        if key not in self._layout:
            self.forget(used_before=self.rounds)
            self._layout = set(self._this_round)

    def get(self, arena_id: int) -> torch.Tensor | None:
        """The arena's bytes if mapped here; counts as used this round."""
        arena = self._bytes.get(arena_id)
        if arena is not None:
            self._used[arena_id] = self.rounds
        return arena

    def add(self, arena_id: int, arena: torch.Tensor) -> None:
        self._bytes[arena_id] = arena
        self._used[arena_id] = self.rounds

    def views(
        self, arena_id: int, copies: list[tuple[int, int, int]], tensors: Sequence[TensorSlice]
    ) -> list[torch.Tensor]:
        """The bucket's tensors as views of mapped arena `arena_id` (computed once)."""
        views = self._views.get(arena_id)
        if views is None:
            views = self._views[arena_id] = arena_views(self._bytes[arena_id], copies, tensors)
        return views

    def forget(self, *, used_before: int) -> None:
        for arena_id, used in list(self._used.items()):
            if used < used_before:
                del self._used[arena_id]
                self._bytes.pop(arena_id, None)
                self._views.pop(arena_id, None)

    def forget_unused(self) -> None:
        """Let go of arenas no round used lately (an old layout's): the engine frees them."""
        self.forget(used_before=self.rounds - 1)

    def forget_all(self) -> None:
        """Let go of every arena (the engine's weights are released: else it frees nothing)."""
        self.forget(used_before=self.rounds + 1)
        self._layout.clear()

    def clear(self) -> None:
        """Drop everything of the attached engine process."""
        self._bytes.clear()
        self._used.clear()
        self._views.clear()
        self._layout.clear()


class CopiesEvents:
    """One interprocess CUDA event per device, recorded after a direct round's copies and
    waited for by the engine before it commits (`finish_staged`). Kept for the adapter's
    life, so the engine opens each one once."""

    def __init__(self) -> None:
        self._events: dict[torch.device, torch.cuda.Event] = {}
        self.usable = True  # False once the engine could not open one

    def get(self, device: torch.device) -> torch.cuda.Event:
        event = self._events.get(device)
        if event is None:
            with torch.cuda.device(device):
                event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            self._events[device] = event
        return event


def event_handle(event: torch.cuda.Event) -> str:
    """How the engine's process opens `event` (base64 of its IPC handle)."""
    return base64.b64encode(event.ipc_handle()).decode()  # type: ignore[no-untyped-call]
