"""The reference engine's weight store: staged, all-or-nothing updates from bucket slots.

Updates never touch the served weights until `commit`: each bucket is copied from the
agent's shared slot into a staging *arena*, one flat buffer per bucket laid out like the
bucket in the slot, so a load is a single memcpy of the bucket's bytes (a multi-tensor
copy only for a bucket whose tensors lie sparsely in the slot). `commit` points every
parameter at its view in the arenas under the model lock, so a generate request sees
either the old version or the new one, and an aborted round leaves the old one
untouched. The arenas freed by a commit become the next round's staging arenas: two
copies of the weights, no allocation per round once a layout has been seen.

Two ways to fill an arena:
* `stage` (the agent copies): the engine picks the bucket's staging arena and shares it
  (CUDA IPC, or shared memory on CPU) with the agent, which copies from its slot into it
  in its own process. On a GPU this keeps the round's GPU work in one process: kernels of
  different processes on one GPU are time-sliced, not overlapped, so an engine-side copy
  stalled the agent's NCCL receive of the next bucket (and was itself ~5x slower).
* `load` (the engine copies): for adapters that cannot map the arenas. Copies run on a
  stream of their own, so a load neither waits behind generation work queued on the
  default stream nor makes generation wait; it returns once its copy is complete, as the
  adapter contract asks (the agent then reuses the slot).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence

import torch

from weightsync.api.engines import MemoryTag
from weightsync.api.reasons import EngineErrorReason
from weightsync.engines.base import EngineError, EngineHealth
from weightsync.reference.arenas import (
    Arena,
    BucketPlan,
    OpenedEvents,
    UpdateStats,
    allocate_arena,
    copy_bucket,
    make_plan,
)
from weightsync.reference.memory import KVCacheReserve, Sleep, storage_bytes, tensor_digest
from weightsync.reference.model import LlamaForCausalLM, greedy_generate
from weightsync.transfer.buffers import (
    SlotHandle,
    SlotHandles,
    describe_slots,
    open_slots,
)
from weightsync.transfer.layout import TensorSlice

log = logging.getLogger(__name__)

UPDATE_LOG_PREFIX = "update phases "
_MAX_CACHED_PLANS = 1 << 16


class ReferenceEngine:
    """The weights a reference server serves and their staged updates.

    `shm_dir`: where CPU arenas live in shared memory so an agent can fill them (`stage`);
    None keeps CPU arenas private (loads only). GPU arenas are always shareable.
    `load_delay_seconds`: a slow engine for tests: each bucket's load (or stage) takes that
    much longer, so a test can act while a round or a recovery is in its middle.
    `kv_cache_bytes`: the KV cache it reserves (`memory.KVCacheReserve`).

    Between Colocated rounds it releases its KV cache and its weights (`release`): the
    weights' arenas and the parameters are freed (each parameter keeps its shape over one
    element), and it refuses inference until a round commits new weights; `resume`
    allocates the KV cache again and the freed arenas as the next round's staging.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        version: int | None = None,
        *,
        shm_dir: str | None = None,
        load_delay_seconds: float = 0.0,
        kv_cache_bytes: int = 0,
    ) -> None:
        self.model = model
        self.version = version
        self.params = dict(model.named_parameters())
        self.device = next(iter(self.params.values())).device
        self._lock = threading.Lock()  # generate vs commit
        self._update_lock = threading.Lock()  # update calls from HTTP and the update channel
        self._slots: list[torch.Tensor] = []
        self._plans: dict[tuple[TensorSlice, ...], BucketPlan] = {}
        self._served: dict[BucketPlan, Arena] = {}  # arenas the parameters point into
        self._spare: dict[BucketPlan, Arena] = {}
        self._staged: dict[BucketPlan, Arena] = {}
        self._staged_names: dict[str, BucketPlan] = {}
        self._staging_version: int | None = None
        self._shm_dir = shm_dir
        self._load_delay = load_delay_seconds
        self._arena_ids = itertools.count(1)
        # Who this process is: a restarted engine (same address) is another incarnation,
        # and nothing an adapter mapped from this one is valid there.
        self.incarnation = uuid.uuid4().hex
        self._stats = UpdateStats()
        self._kv_cache = KVCacheReserve(kv_cache_bytes, self.device)
        self._sleep = Sleep()
        self._freed_plans: list[BucketPlan] = []  # the arenas released with the weights
        self._events = OpenedEvents(self.device)  # agents' copies into the arenas
        self.last_update: UpdateStats | None = None  # the last committed or aborted update
        self._copy_stream = (
            torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if self.device.type == "cuda"
            else None
        )

    # --------------------------------------------------------------- serving
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], int | None]:
        vocab = self.model.config.vocab_size
        if any(not 0 <= token < vocab for prompt in prompts for token in prompt):
            raise EngineError("bad_request", f"token ids must be in [0, {vocab})")
        if any(not prompt for prompt in prompts):
            raise EngineError("bad_request", "empty prompt")
        with self._lock:
            self._sleep.check_awake("generate")
            return greedy_generate(self.model, prompts, max_new_tokens), self.version

    def health(self) -> EngineHealth:
        sleep = self._sleep
        detail = "updating" if self._staging_version is not None else sleep.detail
        return EngineHealth(True, self.version, False, detail, self.incarnation, sleep.released)

    @property
    def resident_bytes(self) -> int:
        """Bytes it holds now: parameters, staging arenas and KV cache (shared once)."""
        with self._update_lock:
            arenas = [*self._served.values(), *self._staged.values(), *self._spare.values()]
            tensors = [*self.params.values(), *(arena.buffer for arena in arenas)]
            return storage_bytes(tensors) + self._kv_cache.nbytes

    # --------------------------------------------------------------- memory
    def release(self, tags: frozenset[MemoryTag]) -> frozenset[MemoryTag]:
        """Free `tags` between rounds; inference is refused until `resume` (and, for the
        weights, a committed round)."""
        with self._update_lock:
            if self._staging_version is not None:
                raise EngineError(
                    EngineErrorReason.SEQUENCE, "release during an update: abort it first"
                )
            with self._lock:
                if MemoryTag.KV_CACHE in tags:
                    self._kv_cache.free()
                if MemoryTag.WEIGHTS in tags and not self._sleep.weights_gone:
                    self._freed_plans = list(self._served)
                    for arena in [*self._served.values(), *self._spare.values()]:
                        arena.release()
                    self._served, self._spare = {}, {}
                    for param in self.params.values():  # one element, shape kept for plans
                        one = torch.empty(1, dtype=param.dtype, device=self.device)
                        param.data = one.expand(param.shape)
                    self._sleep.weights_gone = True
                self._sleep.released |= tags
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("released %s", ", ".join(sorted(tags)) or "nothing")
        return tags

    def resume(self, tags: frozenset[MemoryTag]) -> None:
        """Allocate `tags` again: the KV cache, and the released weights' arenas as the next
        round's staging (their bytes arrive with that round)."""
        with self._update_lock:
            if MemoryTag.WEIGHTS in tags & self._sleep.released:
                for plan in self._freed_plans:
                    self._spare[plan] = self._allocate(plan)
                self._freed_plans = []
            if MemoryTag.KV_CACHE in tags:
                self._kv_cache.allocate()
            self._sleep.released -= tags
        log.info("resumed %s", ", ".join(sorted(tags)) or "nothing")

    @property
    def held_bytes(self) -> int:
        """Bytes in staging arenas: served, staged and spare (the update memory it holds)."""
        with self._update_lock:
            arenas = [*self._served.values(), *self._staged.values(), *self._spare.values()]
            return sum(arena.buffer.numel() for arena in arenas)

    @property
    def staged_buckets(self) -> int:
        """Buckets loaded into the open update so far (0 between updates)."""
        return len(self._staged)

    def digests(self) -> tuple[int | None, dict[str, str]]:
        with self._lock:
            self._sleep.check_weights("digest")
            return self.version, {name: tensor_digest(p) for name, p in self.params.items()}

    # --------------------------------------------------------------- updates
    @property
    def shares_arenas(self) -> bool:
        """Whether `stage` can hand arenas to another process."""
        return self.device.type == "cuda" or self._shm_dir is not None

    def attach(self, handles: SlotHandles, copy: int = 0) -> None:
        """Map the agent's slots: of several copies, this device's (on CPU: `copy`)."""
        slots = open_slots(handles.copy_for(self.device, copy))
        with self._update_lock:
            self._slots = slots

    def begin(self, version: int) -> None:
        # Any version is taken: ordering is the agent's business, and a trainer that
        # restarts from an earlier step (a new lineage) publishes lower numbers again.
        with self._update_lock:
            self._drop_staged()
            self._staging_version = version
            self._stats = UpdateStats()
            if self._copy_stream is not None:
                # Spare arenas were served until the last commit: reads queued before it
                # finish before this update's copies (ours, or an agent's) overwrite them.
                torch.cuda.current_stream(self.device).synchronize()

    def plan(self, tensors: Sequence[TensorSlice]) -> BucketPlan:
        """Check a bucket's tensors against the model once; later loads reuse the plan."""
        key = tuple(tensors)
        plan = self._plans.get(key)
        if plan is None:
            plan = make_plan(self.params, key)
            if len(self._plans) >= _MAX_CACHED_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def load(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        self.load_plan(slot, self.plan(tensors))

    def stage(self, plan: BucketPlan) -> Arena:
        """The arena the agent fills with this bucket; it counts as loaded from now on.

        The caller must finish its copy before it asks for `commit` (the adapter contract
        has `load_bucket` return only then), so the engine never copies anything here.
        """
        started = time.perf_counter()
        self._slow_down()
        with self._update_lock:
            if not self.shares_arenas:
                raise EngineError("unsupported", "this engine's arenas cannot be shared")
            arena = self._take_arena(plan)
            self._stats.add(plan.payload_bytes, time.perf_counter() - started)
            return arena

    def _slow_down(self) -> None:
        if self._load_delay:  # outside the update lock: an abort is not held up by it
            time.sleep(self._load_delay)

    def _take_arena(self, plan: BucketPlan) -> Arena:
        """This update's arena for `plan` (its staged one, a spare, or a new one)."""
        if self._staging_version is None:
            raise EngineError("no_update", "load before begin")
        for item in plan.tensors:
            other = self._staged_names.get(item.name)
            if other is not None and other is not plan:
                raise EngineError("tensor_mismatch", f"{item.name} was loaded twice")
        arena = self._staged.get(plan) or self._spare.pop(plan, None)
        if arena is None:
            self._release_spares()
            arena = self._allocate(plan)
        self._staged[plan] = arena
        for item in plan.tensors:
            self._staged_names[item.name] = plan
        return arena

    def load_plan(self, slot: int, plan: BucketPlan) -> None:
        """Copy one bucket from slot `slot` into its staging arena; return once copied."""
        started = time.perf_counter()
        self._slow_down()
        with self._update_lock:
            if self._staging_version is None:
                raise EngineError("no_update", "load before begin")
            if not 0 <= slot < len(self._slots):
                raise EngineError(
                    "bad_slot", f"slot {slot} not attached ({len(self._slots)} slots)"
                )
            source = self._slots[slot]
            if plan.end > source.numel():
                raise EngineError(
                    "bad_bucket", f"bytes up to {plan.end} lie outside the {source.numel()} B slot"
                )
            arena = self._take_arena(plan)
            copy_bucket(plan, arena, source, self._copy_stream, self.device)
            self._stats.add(plan.payload_bytes, time.perf_counter() - started)

    def _release_spares(self) -> None:
        """A plan with no spare arena means a new layout: the spares are an old layout's and
        this update will not use them. Freed first, staging a new layout needs the served
        weights plus one copy, not two."""
        if not self._spare:
            return
        for arena in self._spare.values():
            arena.release()
        self._spare = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _allocate(self, plan: BucketPlan) -> Arena:
        arena = allocate_arena(plan, self.device, self._shm_dir, next(self._arena_ids))
        self._stats.allocated_bytes += plan.arena_bytes
        return arena

    def find_arena(self, arena_id: int) -> Arena:
        with self._update_lock:
            for arenas in (self._staged, self._spare, self._served):
                for arena in arenas.values():
                    if arena.id == arena_id:
                        return arena
        raise EngineError("bad_bucket", f"no arena {arena_id}")

    def arena_handle(self, arena: Arena) -> SlotHandle:
        """How another process maps `arena` (CUDA IPC, or its shared-memory file)."""
        return describe_slots([arena.buffer]).slots[0]

    def ready(self, version: int) -> None:
        """Raise unless `commit(version)` would succeed (every tensor staged for it)."""
        with self._update_lock:
            self._check_complete(version)

    def _check_complete(self, version: int) -> None:
        if self._staging_version != version:
            raise EngineError("no_update", f"commit of {version} without begin")
        missing = self.params.keys() - self._staged_names.keys()
        if missing:
            raise EngineError(
                "incomplete_update", f"{len(missing)} tensors not loaded, e.g. {min(missing)}"
            )

    def commit(self, version: int, after: bytes | None = None) -> None:
        """Serve `version`; with `after` (an agent's CUDA event), once that completed."""
        if after is not None:
            self._events.wait(after)
        started = time.perf_counter()
        with self._update_lock:
            self._check_complete(version)
            staged = self._staged
            with self._lock:
                for arena in staged.values():
                    for name, view in arena.views.items():
                        self.params[name].data = view
                self.version = version
                self._sleep.weights_gone = False
            self._spare = self._retire(staged)
            self._served = staged
            self._staged, self._staged_names = {}, {}
            self._staging_version = None
            fresh = [plan for plan in staged if plan not in self._spare]
            if fresh and self.device.type == "cuda":
                torch.cuda.empty_cache()  # what the replaced parameters and arenas held
            for plan in fresh:  # a new layout: its next round allocates nothing
                self._spare[plan] = self._allocate(plan)
            self._stats.commit_seconds = time.perf_counter() - started
            self._log_update(version, "committed")

    def _retire(self, staged: dict[BucketPlan, Arena]) -> dict[BucketPlan, Arena]:
        """The arenas served until now are free: the next round's staging for the plans
        now served. Arenas of other plans (an old layout) are let go here, and nothing
        refers to them once this returns, so a new layout's spares can take their room."""
        spare = {plan: arena for plan, arena in self._served.items() if plan in staged}
        for plan, arena in [*self._served.items(), *self._spare.items()]:
            if spare.get(plan) is not arena:
                arena.release()
        return spare

    def abort(self, version: int) -> None:
        """Drop what was staged; the served weights were never touched."""
        with self._update_lock:
            if self._staging_version == version:
                self._drop_staged()
                self._staging_version = None
                self._log_update(version, "aborted")

    def _drop_staged(self) -> None:
        self._spare.update(self._staged)
        self._staged, self._staged_names = {}, {}

    def close(self) -> None:
        """Unlink shared-memory arenas (their mappings stay valid while in use)."""
        with self._update_lock:
            for arenas in (self._served, self._spare, self._staged):
                for arena in arenas.values():
                    arena.release()

    def _log_update(self, version: int, outcome: str) -> None:
        self.last_update = self._stats
        log.info("%s%s", UPDATE_LOG_PREFIX, self._stats.summary(version, outcome))
