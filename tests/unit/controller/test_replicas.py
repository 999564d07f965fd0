"""With leader election a replica runs two kopf operators (`main.build_registries`,
`runtime.operators`): the serving one on every replica must never touch what the
leading one owns, and each operator's end must wait for its own tasks only."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, cast

import kopf

from tests.unit.controller.test_handler_timing import registered
from weightsync.controller import handlers, names
from weightsync.controller.admission.sidecar import AgentTemplate
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.main import SERVING_FINALIZER, build_registries
from weightsync.controller.runtime import operators
from weightsync.controller.runtime.timing import HANDLER_BACKOFF_SECONDS, HANDLER_TIMEOUT_SECONDS
from weightsync.controller.settings import OperatorSettings


def registries() -> tuple[kopf.OperatorRegistry, kopf.OperatorRegistry]:
    nothing = cast(Any, None)
    shared = handlers.Shared(
        settings=OperatorSettings(webhook_url="https://127.0.0.1:9", leader_lease="ws-leader"),
        kube=nothing,
        agents=nothing,
        reconciler=nothing,
        events=nothing,
        template=cast(AgentTemplate, nothing),
        indexes=Indexes(),
    )
    return build_registries(shared, pod_watch=nothing, server=nothing)


def ids(registry: kopf.OperatorRegistry) -> set[str]:
    return {str(h.id) for h in registered(registry)}


def configured(registry: kopf.OperatorRegistry) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    for handler in registry._activities.get_all_handlers():
        if str(handler.id).endswith("configure"):
            handler.fn(settings=settings)
    return settings


def test_the_standby_serves_the_webhooks_and_reconciles_nothing() -> None:
    serving, _ = registries()
    assert len(list(serving._webhooks.get_all_handlers())) == 2
    assert not {"reconcile", "resync", "sources", "release", "watch_pods"} & ids(serving)
    # kopf adds its finalizer only for change or daemon handlers, and *removes* it from
    # watched objects of an operator that has none: the serving operator watches
    # WeightSyncs for its indexes, so its finalizer must not be the leader's.
    assert not list(serving._changing.get_all_handlers())
    assert not list(serving._spawning.get_all_handlers())
    assert configured(serving).persistence.finalizer == SERVING_FINALIZER != names.FINALIZER


def test_the_leader_reconciles_with_indexes_of_its_own_and_serves_no_webhook() -> None:
    _, leading = registries()
    assert {"reconcile", "resync", "sources", "release"} <= ids(leading)
    assert not list(leading._webhooks.get_all_handlers())
    settings = configured(leading)
    assert settings.persistence.finalizer == names.FINALIZER
    assert settings.admission.server is None
    serving_indexes = {str(h.id) for h in registries()[0]._indexing.get_all_handlers()}
    assert serving_indexes == {str(h.id) for h in leading._indexing.get_all_handlers()}


def test_every_handler_of_both_has_its_timeout_and_backoff() -> None:
    for registry in registries():
        for handler in registered(registry):
            assert (handler.timeout, handler.backoff) == (
                HANDLER_TIMEOUT_SECONDS,
                HANDLER_BACKOFF_SECONDS,
            ), handler.id


def test_tasks_belong_to_the_operator_whose_context_created_them() -> None:
    async def scenario() -> dict[str, Any]:
        operators.track_owners(asyncio.get_running_loop())
        found: dict[str, Any] = {}

        async def child() -> None:
            await asyncio.sleep(0)

        async def operator(name: str) -> None:
            operators._OWNER.set(name)
            task = asyncio.create_task(child())
            grandchild = asyncio.create_task(asyncio.sleep(0))
            found[name] = (operators.owner(task), operators.owner(grandchild))
            found[f"{name} ignores"] = (
                task in operators._NotOwnedBy(name),
                task in operators._NotOwnedBy("other"),
            )
            await asyncio.gather(task, grandchild)

        outside = asyncio.create_task(child())
        await asyncio.gather(operator("serving"), operator("leading"), outside)
        found["outside"] = operators.owner(outside)
        return found

    found = asyncio.run(scenario())
    assert found["serving"] == ("serving", "serving")
    assert found["leading"] == ("leading", "leading")
    assert found["serving ignores"] == (False, True)
    assert found["outside"] is None


class FakeElector:
    """Leads when `lead` is set, loses when `lose` is; records the order of events."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.lead, self.lose = asyncio.Event(), asyncio.Event()
        self.leading = False
        self.lost_because = "test"

    async def acquire(self) -> None:
        await self.lead.wait()
        self.leading = True
        self.log.append("acquired")

    async def hold(self) -> None:
        await self.lose.wait()
        self.leading = False

    async def release(self) -> None:
        self.log.append(f"released (leading={self.leading})")
        self.leading = False


class ExitedError(Exception):
    """What `_exit_lost` (os._exit in production) raises here."""


def replicated(monkeypatch: Any, script: Any) -> list[str]:
    """Run `main.run_replicated` with kopf operators that only record their start and
    stop, and `script(elector, log)` driving it; the events in order."""
    from weightsync.controller import main

    log: list[str] = []

    async def fake_operator(name: str, *, stop_flag: asyncio.Event, **_: Any) -> None:
        log.append(f"{name} started")
        await stop_flag.wait()
        await asyncio.sleep(0.05)  # kopf's own stopping takes a moment
        log.append(f"{name} stopped")

    def exit_lost(elector: Any) -> None:
        log.append("exit")
        raise ExitedError

    monkeypatch.setattr(main.operators, "run_operator", fake_operator)
    monkeypatch.setattr(main.operators, "track_owners", lambda loop: None)
    monkeypatch.setattr(main, "_exit_lost", exit_lost)

    async def scenario() -> None:
        elector = FakeElector(log)
        stopping = asyncio.Event()  # what SIGTERM sets
        run = asyncio.create_task(
            main.run_replicated(
                elector,
                None,
                None,
                namespaces=["ns"],
                liveness=None,
                stopping=stopping,  # type: ignore[arg-type]
            )
        )
        await script(elector, log, stopping.set)
        await run

    with contextlib.suppress(ExitedError):
        asyncio.run(scenario())
    return log


def test_sigterm_stops_the_leader_first_then_releases_then_stops_serving(
    monkeypatch: Any,
) -> None:
    async def script(elector: FakeElector, log: list[str], sigterm: Any) -> None:
        await asyncio.sleep(0.05)
        assert log == ["serving started"]  # standing by: admission only
        elector.lead.set()
        await asyncio.sleep(0.05)
        sigterm()

    assert replicated(monkeypatch, script) == [
        "serving started",
        "acquired",
        "leading started",
        "leading stopped",
        "released (leading=True)",
        "serving stopped",
    ]


def test_a_lost_lease_ends_the_process_without_stopping_anything(monkeypatch: Any) -> None:
    async def script(elector: FakeElector, log: list[str], sigterm: Any) -> None:
        elector.lead.set()
        await asyncio.sleep(0.05)
        elector.lose.set()

    log = replicated(monkeypatch, script)
    assert log == ["serving started", "acquired", "leading started", "exit"]


def test_a_standby_stopped_stops_serving_and_never_leads(monkeypatch: Any) -> None:
    async def script(elector: FakeElector, log: list[str], sigterm: Any) -> None:
        await asyncio.sleep(0.05)
        sigterm()

    log = replicated(monkeypatch, script)
    assert log == ["serving started", "released (leading=False)", "serving stopped"]
