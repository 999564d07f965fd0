"""One generation of the sync group: stores, process group, collective thread, pre-warm.

Each generation gets its own store prefix and its own process group, built directly
from the c10d backend classes rather than through `init_process_group`, so several
generations can live in one process: generation g+1 forms and pre-warms in the
background while g still serves rounds, and the switch happens at a round boundary.

All collectives of a generation run on its single collective thread, so the issue
order is the same on every rank and the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from weightsync.api.control import Backend
from weightsync.api.reasons import FailureReason
from weightsync.transfer.broadcast import (
    BroadcastTransport,
    LocalTransport,
    TransferError,
    Transport,
    resolve_backend,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_WARMUP_BYTES = 4096

# One store server per rendezvous port for the life of the process: generations share
# it under different prefixes, so forming g+1 never restarts the server g relies on.
_master_stores: dict[int, TCPStore] = {}
_master_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What one agent needs to join one generation."""

    sync_name: str
    generation: int
    rank: int
    world_size: int
    backend: Backend
    rendezvous_host: str
    rendezvous_port: int
    bind_host: str  # this member's address, for gloo's device
    device: torch.device
    collective_timeout_seconds: float
    prewarm_timeout_seconds: float

    @property
    def prefix(self) -> str:
        return f"weightsync/{self.sync_name}/g{self.generation}"


def _master_store(port: int, timeout: timedelta) -> TCPStore:
    with _master_lock:
        store = _master_stores.get(port)
        if store is None:
            store = TCPStore(
                "0.0.0.0",  # noqa: S104 - the rendezvous must be reachable from every pod
                port,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
            )
            _master_stores[port] = store
        return store


class CollectiveThread:
    """One daemon thread running submitted calls in order.

    Not a ThreadPoolExecutor: its threads are joined at interpreter exit, and a thread
    stuck in a backend call (a peer that never came) must not keep the agent alive.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None] = (
            queue.SimpleQueue()
        )
        self._stopped = False
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._stopped:
            # A round that reaches a generation retired or broken under it fails like any
            # transfer (named, bounded label); a bare RuntimeError read as internal_error.
            raise TransferError(
                FailureReason.GENERATION_CLOSED, "the generation was closed under the round"
            )
        future: Future[T] = Future()
        self._calls.put((fn, future))  # type: ignore[arg-type]
        return future

    def stop(self) -> None:
        self._stopped = True
        self._calls.put(None)


def _detached(fn: Callable[[], None], name: str) -> None:
    """Run `fn` on a daemon thread nobody waits for (it may block on a dead peer)."""
    threading.Thread(target=fn, name=name, daemon=True).start()


def _clone(store: Store) -> Store:
    """A new connection to the same store (`clone` is missing from torch's stubs)."""
    clone: Store = store.clone()  # type: ignore[attr-defined]
    return clone


class Group:
    """A generation's transport plus its control store. Build with `form_group`."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.broken_reason: str | None = None
        self.prewarm_seconds: float | None = None
        self.transport: Transport = LocalTransport()
        self._worker = CollectiveThread(f"ws-g{spec.generation}-coll")
        self._ctl: Store | None = None
        self._doorbell: Store | None = None

    @property
    def ctl(self) -> Store:
        """The generation's control keys (layout, doorbells, failure flags)."""
        if self._ctl is None:
            raise TransferError(
                FailureReason.NOT_FORMED, f"generation {self.spec.generation} is not formed"
            )
        return self._ctl

    @property
    def doorbell_store(self) -> Store:
        """A second connection to the control keys, for the blocking doorbell wait."""
        if self._doorbell is None:
            raise TransferError(
                FailureReason.NOT_FORMED, f"generation {self.spec.generation} is not formed"
            )
        return self._doorbell

    def _connect(self) -> Store:
        spec = self.spec
        timeout = timedelta(seconds=spec.prewarm_timeout_seconds)
        base: Store
        if spec.rank == 0:
            base = _clone(_master_store(spec.rendezvous_port, timeout))
        else:
            base = TCPStore(
                spec.rendezvous_host,
                spec.rendezvous_port,
                is_master=False,
                timeout=timeout,
                wait_for_workers=False,
            )
        base.set_timeout(timedelta(seconds=spec.collective_timeout_seconds))
        # Separate connections: the doorbell thread blocks in `wait` while the
        # collective thread checks the failure key.
        self._ctl = PrefixStore(f"{spec.prefix}/ctl/", base)
        self._doorbell = PrefixStore(f"{spec.prefix}/ctl/", _clone(base))
        return PrefixStore(f"{spec.prefix}/pg/", _clone(base))

    def _make_pg(self, store: Store) -> C10dBackend:
        spec = self.spec
        # The backend's own timeout is a backstop well behind our per-wait deadlines, so
        # that we abort first (the NCCL watchdog would otherwise act on its own).
        timeout = timedelta(seconds=2 * spec.collective_timeout_seconds + 30)
        if spec.backend == Backend.GLOO:
            # `_Options` (not the stub's `Options`) is the constructible options class.
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=spec.bind_host)]
            return ProcessGroupGloo(store, spec.rank, spec.world_size, opts)
        from torch._C._distributed_c10d import ProcessGroupNCCL

        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        torch.cuda.set_device(spec.device)
        pg = ProcessGroupNCCL(store, spec.rank, spec.world_size, nccl_opts)
        pg.eager_connect_single_device(spec.device)  # create the communicator now
        return pg

    def form_blocking(self) -> None:
        """Connect, build the process group and pre-warm it (barrier + small broadcast)."""
        spec = self.spec
        started = time.monotonic()
        deadline = started + spec.prewarm_timeout_seconds
        pg_store = self._connect()
        if spec.world_size == 1:
            self.prewarm_seconds = time.monotonic() - started
            return
        resolve_backend(spec.backend, spec.device)
        transport = BroadcastTransport(self._make_pg(pg_store), device=spec.device, ctl=self.ctl)
        self.transport = transport
        transport.barrier_blocking(deadline=deadline)
        marker = spec.generation % 251 + 1
        probe = torch.zeros(_WARMUP_BYTES, dtype=torch.uint8, device=spec.device)
        if spec.rank == 0:
            probe.fill_(marker)
        transport.wait(transport.start_bucket(probe), deadline=deadline, failure_key=None)
        if int(probe[-1].item()) != marker:
            raise TransferError(
                FailureReason.PREWARM_CORRUPT, "warm-up broadcast delivered the wrong bytes"
            )
        self.prewarm_seconds = time.monotonic() - started

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on this generation's collective thread."""
        return await asyncio.wrap_future(self._worker.submit(fn))

    async def wait_key(self, key: str, quiet_after: timedelta) -> bytes | None:
        """Wait for a control key on the doorbell connection; None after `quiet_after`.

        Runs on a daemon thread of its own: a blocking store wait cannot be interrupted,
        and an idle sink must still be able to exit at once.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bytes | None] = loop.create_future()
        store = self.doorbell_store

        def settle(value: bytes | None, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(value)

        def hand_over(value: bytes | None, error: BaseException | None) -> None:
            # The agent may have stopped while this thread waited (a pod deleted while
            # its sink idled): nobody is left to tell, and a raise here would end this
            # thread with a traceback in a clean shutdown's log.
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                loop.call_soon_threadsafe(settle, value, error)

        def wait() -> None:
            try:
                store.wait([key], quiet_after)
                value: bytes | None = store.get(key)
            except dist.DistStoreError:
                value = None  # a quiet slice
            except (dist.DistError, RuntimeError) as exc:
                hand_over(None, exc)
                return
            hand_over(value, None)

        threading.Thread(
            target=wait, name=f"ws-g{self.spec.generation}-doorbell", daemon=True
        ).start()
        return await done

    def abort(self, reason: str) -> None:
        """Mark broken and abort the communicator; never waits on it or on peers.

        A backend's abort can block until its pending operation ends (gloo's waits for
        its own timeout, 2 x the round's + 30 s): it runs on a thread of its own that
        nobody joins, and the generation is abandoned for a new one.
        """
        if self.broken_reason is None:
            self.broken_reason = reason
            log.warning("generation %d broken: %s", self.spec.generation, reason)
        _detached(self.transport.abort, f"ws-g{self.spec.generation}-abort")

    def close(self) -> None:
        """Release the group after the switch to a newer generation (or after abort)."""
        if isinstance(self.transport, BroadcastTransport) and self.broken_reason is None:
            _detached(self.transport.shutdown, f"ws-g{self.spec.generation}-shutdown")
        self._worker.stop()


async def form_group(spec: GroupSpec) -> Group:
    """Form and pre-warm a generation; raises `TransferError` on failure or timeout."""
    group = Group(spec)
    try:
        await asyncio.wait_for(
            group.run(group.form_blocking), timeout=spec.prewarm_timeout_seconds + 5.0
        )
    except (TimeoutError, dist.DistError, RuntimeError) as exc:
        group.abort(f"formation failed: {exc}")
        group.close()
        if isinstance(exc, TransferError):
            raise
        raise TransferError(
            FailureReason.FORMATION_FAILED, f"generation {spec.generation}: {exc}"
        ) from exc
    log.info(
        "generation %d formed: rank %d/%d, pre-warm %.3f s",
        spec.generation,
        spec.rank,
        spec.world_size,
        group.prewarm_seconds or 0.0,
    )
    return group
