"""The round both HTTP engines share: pause, open a session, load, commit, resume, verify.

SGLang and vLLM both load in place between a "begin" and a "finish" call, and both keep a
free-form `weight_version` string. `RoundAdapter` drives the common shape and leaves the
endpoints to the engine modules:

* begin: read the served label, pause, open the engine's update session, write the
  partial marker (so an engine left half-loaded reports it, whoever asks);
* finish: commit (the engine's own finish, which also writes the served label), resume,
  then read the label back: anything but the finished version is an error;
* abort: close the session, repair what a failed load left (`_repair`: vLLM's model on
  the meta device), write the old label back if nothing was loaded (the old weights are
  intact), resume. After a load the marker stays and `health` says torn; an engine that
  cannot generate safely while torn (`resumes_torn` false: vLLM) stays paused: its
  requests wait, and the next round's pause ends or keeps them as its mode says. An
  engine whose repair failed is not resumed: it would serve, or crash on, a half-built
  model.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from pydantic import SecretStr

from weightsync.api.engines import WAKE_ORDER, MemoryTag
from weightsync.api.reasons import EngineErrorReason
from weightsync.engines import _versions
from weightsync.engines._http import EngineHTTP, Reply, engine_message, error_reason
from weightsync.engines._ipc import LogicalSlot, export_slots
from weightsync.engines.base import EngineAdapter, EngineError, EngineHealth
from weightsync.transfer.layout import TensorSlice

if TYPE_CHECKING:
    import torch

    from weightsync.api.engines import EngineOptions

log = logging.getLogger(__name__)

HTTP_OK = 200


@dataclass
class Round:
    """What the adapter knows about the update in progress."""

    version: int
    previous_label: object  # the engine's weight_version before the round
    session_open: bool = False
    marked: bool = False  # the partial marker is written
    loads_attempted: int = 0
    load_failed: bool = False  # a load was refused or failed inside the engine


class EngineSettings(Protocol):
    """What `RoundAdapter` reads from an engine's settings (`SGLangSettings`,
    `VLLMSettings`); each model adds its own pause and load options."""

    @property
    def base_url(self) -> str: ...
    @property
    def api_key(self) -> SecretStr | None: ...
    @property
    def connect_timeout_seconds(self) -> float: ...
    @property
    def control_timeout_seconds(self) -> float: ...
    @property
    def health_timeout_seconds(self) -> float: ...
    @classmethod
    def from_weightsync(
        cls, base_url: str, *, pause_mode: str = ..., flush_cache: bool = ...
    ) -> Self: ...


SettingsT = TypeVar("SettingsT", bound=EngineSettings)


class RoundAdapter(EngineAdapter, Generic[SettingsT]):
    """An engine behind HTTP that loads in place inside a begin/finish session.

    Built from the engine's settings, or from its base URL alone (`settings_class`'s
    defaults otherwise), as `weightsync.engines` documents for every adapter.
    """

    engine_name = "engine"
    settings_class: type[SettingsT]  # the settings model, built by its from_weightsync
    # Whether a torn engine (an aborted round reached it) may generate until the next
    # complete round. Where false it stays paused: requests wait, none is answered by it.
    resumes_torn = True

    def __init__(self, settings: SettingsT | str) -> None:
        if isinstance(settings, str):
            settings = self.settings_class.from_weightsync(settings)
        self.settings: SettingsT = settings
        self._http = EngineHTTP(
            settings.base_url,
            connect_timeout_seconds=settings.connect_timeout_seconds,
            api_key=settings.api_key,
        )
        self._control_timeout = settings.control_timeout_seconds
        self._health_timeout = settings.health_timeout_seconds
        self._slots: list[LogicalSlot] = []
        self._round: Round | None = None
        self._released: frozenset[MemoryTag] = frozenset()  # as this adapter asked

    @classmethod
    def for_engine(cls, base_url: str, options: EngineOptions | None = None) -> Self:
        if options is None:
            return cls(base_url)  # from_weightsync's defaults, the entry's defaults
        settings = cls.settings_class.from_weightsync(
            base_url, pause_mode=options.pause_mode.value, flush_cache=options.flush_cache
        )
        return cls(settings)

    # -- what each engine provides ------------------------------------------------------

    @abc.abstractmethod
    async def _read_label(self, timeout_seconds: float) -> object:
        """The engine's current weight_version."""

    @abc.abstractmethod
    async def _write_label(self, label: str) -> None:
        """Set the engine's weight_version without touching weights."""

    @abc.abstractmethod
    async def _pause(self) -> None: ...

    @abc.abstractmethod
    async def _resume(self) -> None: ...

    @abc.abstractmethod
    async def _open_session(self) -> None:
        """Open the engine's update session (closing one an earlier agent left open)."""

    @abc.abstractmethod
    async def _close_session(self) -> None:
        """Close the session without committing a version (abort)."""

    @abc.abstractmethod
    async def _commit(self, version: int) -> None:
        """Close the session, make the new weights final and write the served label."""

    @abc.abstractmethod
    async def _load(self, round_: Round, slot: int, tensors: Sequence[TensorSlice]) -> None:
        """Hand one bucket to the engine; count each request in `round_.loads_attempted`."""

    @abc.abstractmethod
    async def _release(self, tags: frozenset[MemoryTag]) -> frozenset[MemoryTag]:
        """Ask the engine to free `tags`; what it freed."""

    @abc.abstractmethod
    async def _wake(self, tag: MemoryTag) -> None:
        """Ask the engine to allocate `tag` again."""

    async def _read_released(self) -> frozenset[MemoryTag] | None:
        """What the engine says it has released; None where it does not say."""
        return None

    def _check_slots(self, slots: list[LogicalSlot]) -> None:
        """Refuse slots this engine cannot read (raise ValueError)."""

    async def _repair(self, round_: Round) -> None:
        """Make the engine safe to resume after an aborted round (raise if it is not)."""

    # -- HTTP helpers ----------------------------------------------------------------------

    async def _call(
        self,
        path: str,
        timeout_seconds: float,
        body: Any = None,
        *,
        method: str = "POST",
        params: dict[str, str] | None = None,
    ) -> Reply:
        """One request; an error status becomes `EngineError` with the engine's message."""
        reply = await self._http.request(
            method, path, timeout_seconds=timeout_seconds, json_body=body, params=params
        )
        if reply.status >= 400:
            raise EngineError(
                error_reason(reply.status),
                f"{self.engine_name} {path}: HTTP {reply.status}: {engine_message(reply)}",
            )
        return reply

    # -- EngineAdapter -------------------------------------------------------------------

    async def attach_buffers(self, slots: Sequence[torch.Tensor], copies: int = 1) -> None:
        exported = export_slots(slots, copies)
        self._check_slots(exported)
        self._slots = exported

    async def begin_update(self, version: int) -> None:
        if self._round is not None:
            raise EngineError(
                EngineErrorReason.SEQUENCE,
                f"update {self._round.version} is still open; abort it first",
            )
        previous = await self._read_label(self._control_timeout)
        round_ = Round(version=version, previous_label=previous)
        self._round = round_
        try:
            if not self._released:  # asleep, the release stopped its scheduler already
                await self._pause()
            await self._open_session()
            round_.session_open = True
            await self._write_label(_versions.partial_label(version))
            round_.marked = True
        except EngineError:
            await self._unwind(round_)
            raise

    async def load_bucket(self, slot: int, tensors: Sequence[TensorSlice]) -> None:
        round_ = self._round
        if round_ is None:
            raise EngineError(
                EngineErrorReason.SEQUENCE, "load_bucket outside begin_update/finish_update"
            )
        await self._load(round_, slot, tensors)

    async def finish_update(self, version: int) -> None:
        round_ = self._round
        if round_ is None or round_.version != version:
            raise EngineError(
                EngineErrorReason.SEQUENCE, f"finish_update({version}) without its begin"
            )
        await self._commit(version)
        round_.session_open = False
        round_.marked = False
        self._round = None
        await self._resume_unless_asleep()
        served = await self._read_label(self._control_timeout)
        if served != _versions.served_label(version):
            raise EngineError(
                EngineErrorReason.VERSION_MISMATCH,
                f"{self.engine_name} reports weight_version {served!r} after finishing {version}",
            )

    async def abort_update(self, version: int, reason: str) -> None:
        round_ = self._round
        if round_ is not None and round_.version != version:
            raise EngineError(
                EngineErrorReason.SEQUENCE, f"abort_update({version}) during {round_.version}"
            )
        log.warning("aborting update %d on %s: %s", version, self._http.base_url, reason)
        await self._unwind(round_)

    async def _unwind(self, round_: Round | None) -> None:
        """Leave the engine serving, or paused where it is torn and may not serve so;
        raise if it could not be resumed, or left paused as a step failed."""
        self._round = None
        failures: list[EngineError] = []
        if round_ is not None and round_.session_open:
            try:
                await self._close_session()
            except EngineError as err:
                failures.append(err)
        if round_ is not None:
            try:
                await self._repair(round_)
            except EngineError as err:
                raise EngineError(
                    err.reason,
                    f"{self.engine_name} left paused, not resumed: {_joined([err, *failures])}",
                ) from err
        if round_ is not None and round_.marked and round_.loads_attempted == 0:
            # Nothing reached the engine: the old weights are intact and the old label true.
            previous = round_.previous_label
            try:
                await self._write_label(previous if isinstance(previous, str) else "default")
            except EngineError as err:
                failures.append(err)
        if round_ is not None and round_.loads_attempted and not self.resumes_torn:
            if failures:
                raise EngineError(
                    failures[0].reason,
                    f"{self.engine_name} left paused, torn: {_joined(failures)}",
                ) from failures[0]
            log.warning(
                "%s left paused after aborting update %d: torn, requests wait for a complete round",
                self._http.base_url,
                round_.version,
            )
            return
        try:
            await self._resume_unless_asleep()
        except EngineError as err:
            raise EngineError(err.reason, _joined([*failures, err])) from err
        if failures:
            log.warning("abort on %s: %s", self._http.base_url, _joined(failures))

    async def _resume_unless_asleep(self) -> None:
        # Generation restarted while part of the engine's memory is still released would
        # run on a KV cache that is not there: the last wake restarts it (`_awake`).
        if not self._released:
            await self._resume()

    async def _awake(self) -> None:
        """Every released tag is back: let the engine generate (vLLM's last wake does)."""

    async def release_memory(self, tags: frozenset[MemoryTag]) -> frozenset[MemoryTag]:
        if not tags:
            return tags
        if self._round is not None:
            raise EngineError(
                EngineErrorReason.SEQUENCE,
                f"release during the update to {self._round.version}: abort it first",
            )
        freed = await self._release(tags)
        self._released |= freed
        return freed

    async def resume_memory(self, tags: frozenset[MemoryTag]) -> None:
        for tag in WAKE_ORDER:
            if tag in tags:
                await self._wake(tag)
                self._released -= {tag}
        if tags and not self._released:
            await self._awake()

    async def released_memory(self) -> frozenset[MemoryTag] | None:
        if self._round is not None:
            raise EngineError(
                EngineErrorReason.SEQUENCE, f"asked during the update to {self._round.version}"
            )
        released = await self._read_released()
        if released is not None:
            self._released = released
        return released

    async def health(self) -> EngineHealth:
        if self._released:  # asleep as asked: its /health may not say so
            asleep = f"sleeping: {', '.join(sorted(self._released))} released"
            health = await self._health()
            return dataclasses.replace(health, detail=f"{asleep}; {health.detail}")
        return await self._health()

    async def _health(self) -> EngineHealth:
        try:
            label = await self._read_label(self._health_timeout)
        except EngineError as err:
            return EngineHealth(healthy=False, version=None, detail=str(err))
        round_ = self._round
        if round_ is not None:
            # Paused mid-round: a liveness probe that generates would queue behind the pause.
            previous = _versions.parse_label(round_.previous_label)
            return EngineHealth(
                healthy=True,
                version=previous.version,
                torn=previous.partial,
                detail=f"loading version {round_.version}",
            )
        parsed = _versions.parse_label(label)
        detail = f"weight_version {label!r}"
        if parsed.partial:
            detail += ": an update was started and not finished, the weights are mixed"
        try:
            reply = await self._http.request("GET", "/health", timeout_seconds=self._health_timeout)
        except EngineError as err:
            return EngineHealth(False, parsed.version, parsed.partial, f"{detail}; {err}")
        if reply.status != HTTP_OK:
            detail += f"; /health answered {reply.status}"
        return EngineHealth(reply.status == HTTP_OK, parsed.version, parsed.partial, detail)

    async def close(self) -> None:
        await self._http.close()


def _joined(errors: Sequence[EngineError]) -> str:
    return "; ".join(str(err) for err in errors)
