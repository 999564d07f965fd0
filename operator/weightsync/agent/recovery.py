"""Recovery: a restarted sink agent pulls the current version from holders and loads it.

`POST /v1/recover` starts `Recovery.start`, which runs in the background:
1. ask every named holder for its `Holding` (`GET /v1/holding`); keep those that hold the
   requested version over the requested protocol and agree on the layout (the largest
   group by layout hash; the others are dropped with the reason);
2. reuse (or allocate) the agent's bucket slots for that layout and attach them to the
   engine;
3. pull bucket by bucket into the slots (`bucket_pull.pull_buckets`), up to `depth`
   buckets ahead of the engine, each bucket from all live holders (the bucket's
   preferred holder rotates, so they take turns), its checksum verified; a holder whose
   read or checksum fails is dropped for the rest of the recovery;
4. hand each bucket to the engine (`begin_update` / `load_bucket` / `finish_update`;
   `abort_update` on any failure), then report.
Only this agent and its engine do any work: holders serve reads passively and running
engines see nothing of it.

On a CUDA agent the bytes land in pinned host buffers first and are copied to the slot
from there: the held checksums are CRC-32 over host bytes, and the transfer engine then
needs no GPUDirect registration of device memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from weightsync.agent.bucket_pull import PullSummary, pull_buckets
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.slot_pool import SlotPool
from weightsync.api.control import Holding, RecoverRequest, RecoveryState, RecoveryStatus
from weightsync.api.reasons import ErrorCode, RecoveryFailureReason
from weightsync.engines.base import EngineAdapter, EngineError
from weightsync.transfer.layout import Bucket, BucketLayout, LayoutError
from weightsync.transfer.p2p import Endpoints, HeldRegion, P2PError

log = logging.getLogger(__name__)

# A recovery that stops (failed, or yielding to a round) tells its engine at once and
# does not wait longer: the next update's begin drops whatever it had staged.
_ABORT_GRACE_SECONDS = 1.0

_HOLDING_TIMEOUT_SECONDS = 10.0  # one holder's answer to GET /v1/holding


class RecoveryFailed(Exception):  # noqa: N818 - an outcome carried up, like RoundFailed
    """A recovery failed; `reason` is a metric label, `dropped` the holders left out."""

    def __init__(self, reason: str, message: str, dropped: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.dropped = dict(dropped or {})


# ---------------------------------------------------------------------- choosing holders
async def fetch_holdings(
    urls: Sequence[str], token: str, timeout_seconds: float
) -> tuple[dict[str, Holding], dict[str, str]]:
    """Every holder's `Holding`, asked at once: (answers by URL, why not by URL)."""
    timeout = aiohttp.ClientTimeout(total=timeout_seconds)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        answers = await asyncio.gather(*(_fetch_one(session, url) for url in urls))
    holdings: dict[str, Holding] = {}
    failed: dict[str, str] = {}
    for url, answer in zip(urls, answers, strict=True):
        if isinstance(answer, Holding):
            holdings[url] = answer
        else:
            failed[url] = answer
    return holdings, failed


async def _fetch_one(session: aiohttp.ClientSession, url: str) -> Holding | str:
    try:
        async with session.get(f"{url}/v1/holding") as reply:
            body = await reply.read()
            if reply.status == 404:
                return f"{ErrorCode.NOT_HOLDING}: the agent holds no version"
            if reply.status != 200:
                return f"http_{reply.status}: {body[:200]!r}"
        return Holding.model_validate_json(body)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"unreachable: {type(exc).__name__}: {exc}"
    except ValidationError as exc:
        return f"bad_holding: {exc.error_count()} validation errors"


@dataclass(frozen=True)
class Agreement:
    """The holders a recovery pulls from, the version and layout they agree on, and who
    was dropped."""

    layout: BucketLayout
    checksums: list[int]
    holders: list[tuple[str, Holding]]  # in request order
    dropped: dict[str, str]

    @property
    def version(self) -> int:
        return self.holders[0][1].version

    @property
    def lineage(self) -> str:
        return self.holders[0][1].lineage


def _screen(
    holding: Holding,
    request: RecoverRequest,
    layouts: dict[str, BucketLayout],
) -> BucketLayout | str:
    """The holding's layout if it can serve this recovery, else why not."""
    refusals = (
        (
            bool(request.lineage) and holding.lineage != request.lineage,
            f"lineage_mismatch: holds {holding.lineage or 'none'}, not {request.lineage}",
        ),
        (
            holding.version < request.version,
            f"version_mismatch: holds {holding.version}, older than {request.version}",
        ),
        (
            holding.protocol != request.protocol,
            f"protocol_mismatch: serves {holding.protocol}, not {request.protocol}",
        ),
    )
    for refused, why in refusals:
        if refused:
            return why
    layout = layouts.get(holding.layout)
    if layout is None:
        try:
            layout = layouts[holding.layout] = BucketLayout.from_json(holding.layout)
        except (LayoutError, ValueError, KeyError) as exc:
            return f"bad_layout: {exc}"
    if layout.layout_hash != holding.layout_hash:
        return "bad_layout: layout and layout hash disagree"
    if len(holding.checksums) != len(layout.buckets) or holding.nbytes < layout.total_bytes:
        return "bad_holding: checksums or size do not match the layout"
    return layout


def choose_holders(
    request: RecoverRequest,
    order: Sequence[str],
    holdings: Mapping[str, Holding],
) -> Agreement:
    """Keep the holders of the newest version at or after `request.version` (of its
    lineage, over its protocol) that agree on one layout and checksums.

    The newest: the trainer may have published while the pod was recovering; an older
    one would leave it behind again. Holders disagreeing with the largest group (ties:
    the one named first) are dropped: two holders of one version that disagree cannot
    both be right, and a pull verifies against one set of checksums.
    """
    dropped: dict[str, str] = {}
    candidates: list[tuple[str, Holding, BucketLayout]] = []
    layouts: dict[str, BucketLayout] = {}
    for url in order:
        holding = holdings.get(url)
        if holding is None:
            continue
        screened = _screen(holding, request, layouts)
        if isinstance(screened, str):
            dropped[url] = screened
        else:
            candidates.append((url, holding, screened))
    if not candidates:
        raise RecoveryFailed(
            RecoveryFailureReason.NO_HOLDER,
            f"no holder can serve version {request.version} or newer",
            dropped,
        )
    newest = max(h.version for _, h, _ in candidates)
    for url, holding, _ in candidates:
        if holding.version != newest:
            dropped[url] = f"older_version: holds {holding.version}, others {newest}"
    candidates = [c for c in candidates if c[1].version == newest]
    groups = Counter((h.layout_hash, tuple(h.checksums)) for _, h, _ in candidates)
    best = max(groups.values())
    key = next(k for k in groups if groups[k] == best)  # Counter keeps first-seen order
    chosen: list[tuple[str, Holding]] = []
    for url, holding, _ in candidates:
        if (holding.layout_hash, tuple(holding.checksums)) == key:
            chosen.append((url, holding))
        elif holding.layout_hash != key[0]:
            dropped[url] = f"layout_mismatch: {holding.layout_hash[:12]} != {key[0][:12]}"
        else:
            dropped[url] = "checksum_mismatch: disagrees with the other holders"
    layout = next(layout for url, _, layout in candidates if url == chosen[0][0])
    return Agreement(layout, list(key[1]), chosen, dropped)


# ---------------------------------------------------------------------- the agent's side
class Recovery:
    """An agent's recoveries: one at a time, in the background; the latest one's status."""

    def __init__(
        self,
        *,
        pool: SlotPool,
        adapter: EngineAdapter,
        endpoints: Endpoints,
        metrics: AgentMetrics,
        token: Callable[[], str],
        depth: Callable[[], int],
        engine_timeout_seconds: float,
        on_recovered: Callable[[int, str], None],
    ) -> None:
        self._pool = pool
        self._adapter = adapter
        self._endpoints = endpoints
        self._metrics = metrics
        self._token = token
        self._depth = depth
        self._engine_timeout = engine_timeout_seconds
        self._on_recovered = on_recovered
        self._task: asyncio.Task[None] | None = None
        self._request: RecoverRequest | None = None
        self._version: int | None = None  # the version chosen from the holders
        self._recovered: tuple[int, str] | None = None
        self._state = RecoveryState.PENDING
        self._started = 0.0
        self._started_wall = 0.0
        self._seconds = 0.0
        self._reason = ""
        self._message = ""
        self._dropped: dict[str, str] = {}
        self._summary = PullSummary()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def status(self) -> RecoveryStatus | None:
        """The latest recovery as the control API reports it (bytes count up while running)."""
        return None if self._request is None else self._report(self._request)

    def _report(self, request: RecoverRequest) -> RecoveryStatus:
        summary = self._summary
        seconds = self._seconds if not self.running else time.monotonic() - self._started
        done = self._state == RecoveryState.DONE
        return RecoveryStatus(
            state=self._state,
            version=request.version if self._version is None else self._version,
            lineage=self._recovered[1] if self._recovered else request.lineage,
            bytes=summary.bytes,
            duration_millis=round(seconds * 1000),
            bandwidth_bytes_per_second=int(summary.bytes / seconds) if done and seconds else 0,
            reason=self._reason,
            message=self._message,
            holders_used=[url for url, moved in summary.bytes_by_holder.items() if moved > 0],
            holders_failed={**self._dropped, **summary.failed_holders},
            started_at_unix_millis=int(self._started_wall * 1000),
        )

    def start(self, request: RecoverRequest) -> RecoveryStatus:
        if self.running:
            raise RecoveryFailed(RecoveryFailureReason.BUSY, "a recovery is already running")
        self._request = request
        self._version, self._recovered = None, None
        self._state = RecoveryState.PENDING
        self._started, self._started_wall, self._seconds = time.monotonic(), time.time(), 0.0
        self._reason = self._message = ""
        self._dropped = {}
        self._summary = PullSummary()
        self._task = asyncio.create_task(self._run(request), name=f"recover-v{request.version}")
        return self._report(request)

    async def _run(self, request: RecoverRequest) -> None:
        self._state = RecoveryState.RUNNING
        try:
            version, lineage = await self._recover(request, self._started + request.timeout_seconds)
        except (RecoveryFailed, P2PError) as exc:
            self._finish(RecoveryState.FAILED, exc.reason, str(exc))
        except Exception as exc:  # the operator gets a failed status whatever went wrong
            log.exception("recovery of version %d failed unexpectedly", request.version)
            self._finish(RecoveryState.FAILED, RecoveryFailureReason.INTERNAL_ERROR, repr(exc))
        else:
            self._recovered = (version, lineage)
            self._finish(RecoveryState.DONE, "", "")
            self._metrics.recovery_succeeded(self._seconds, self._summary.bytes, version)
            self._on_recovered(version, lineage)

    def _finish(self, state: RecoveryState, reason: str, message: str) -> None:
        self._seconds = time.monotonic() - self._started
        self._state, self._reason, self._message = state, reason, message
        if state == RecoveryState.FAILED:
            log.warning("recovery failed (%s): %s", reason, message)
            self._metrics.recovery_failed(reason)
        else:
            log.info(
                "recovered version %d: %d B in %.3f s from %s",
                self._version if self._version is not None else -1,
                self._summary.bytes,
                self._seconds,
                sorted(self._summary.bytes_by_holder),
            )

    async def _recover(self, request: RecoverRequest, deadline: float) -> tuple[int, str]:
        """Pull and load the newest held version at or after the one asked for."""
        wait = min(_HOLDING_TIMEOUT_SECONDS, max(deadline - time.monotonic(), 0.1))
        holdings, unreachable = await fetch_holdings(request.holders, self._token(), wait)
        self._dropped.update(unreachable)
        try:
            agreement = choose_holders(request, request.holders, holdings)
        except RecoveryFailed as exc:
            self._dropped.update(exc.dropped)
            raise
        self._dropped.update(agreement.dropped)
        self._version = agreement.version
        layout = agreement.layout
        slots = self._pool.ensure(layout, self._depth()).slots
        endpoint = await asyncio.to_thread(self._endpoints.get, request.protocol)
        regions = [HeldRegion(url, h.segment, h.address, h.nbytes) for url, h in agreement.holders]
        adapter, version = self._adapter, agreement.version
        pool = self._pool
        await self._engine("attach", adapter.attach_buffers(pool.engine_slots(), pool.copy_count))
        await self._engine("begin", adapter.begin_update(version))
        try:
            await pull_buckets(
                endpoint,
                regions,
                layout,
                agreement.checksums,
                slots,
                deadline=deadline,
                load=self._load,
                summary=self._summary,
            )
            await self._engine("finish", adapter.finish_update(version))
        except (RecoveryFailed, P2PError) as exc:
            await self._abort(version, exc.reason)
            raise
        except BaseException:
            await self._abort(version, RecoveryFailureReason.INTERNAL_ERROR)
            raise
        return version, agreement.lineage

    async def _load(self, bucket: Bucket, slot: int) -> None:
        # The pull landed in the receiving device's slot; the engine's other devices
        # read their own copies.
        await self._pool.replicate(slot, bucket.nbytes).wait()
        await self._engine(
            f"load bucket {bucket.index}", self._adapter.load_bucket(slot, bucket.tensors)
        )

    async def _engine(self, what: str, call: Awaitable[None]) -> None:
        try:
            await asyncio.wait_for(call, self._engine_timeout)
        except EngineError as exc:
            raise RecoveryFailed(f"engine_{exc.reason}", f"{what}: {exc}") from exc
        except TimeoutError as exc:
            raise RecoveryFailed(RecoveryFailureReason.ENGINE_TIMEOUT, f"{what} timed out") from exc

    async def _abort(self, version: int, reason: str) -> None:
        try:
            await asyncio.wait_for(
                self._adapter.abort_update(version, reason),
                min(self._engine_timeout, _ABORT_GRACE_SECONDS),
            )
        except (EngineError, TimeoutError) as exc:
            log.warning("engine abort after a failed recovery failed: %s", exc)

    async def yield_to_round(self) -> None:
        """A round is starting: it brings the engine the whole version anyway, and needs
        the slots and the engine. Stop a running recovery (it reports `failed`,
        `yielded`) and wait until it let go of both."""
        task = self._task
        if task is None or task.done():
            return
        log.info("a round starts: stopping the recovery of version %s", self._version)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self._state == RecoveryState.RUNNING:
            self._finish(
                RecoveryState.FAILED,
                RecoveryFailureReason.YIELDED,
                "a round started; it loads the version",
            )

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
