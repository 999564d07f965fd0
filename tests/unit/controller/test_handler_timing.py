"""kopf owns retries: every handler the operator registers has `timeout=` and `backoff=`
(`runtime.timing`), so a new handler without them fails here, not in production."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import kopf
import pytest

from weightsync.controller import handlers
from weightsync.controller.admission.sidecar import AgentTemplate
from weightsync.controller.cluster.cache import Indexes
from weightsync.controller.main import build_registry, configure_kopf
from weightsync.controller.runtime.timing import (
    HANDLER_BACKOFF_SECONDS,
    HANDLER_TIMEOUT_SECONDS,
    PASS_TIMEOUT_SECONDS,
    TIMER_EXIT_POLL_SECONDS,
)
from weightsync.controller.settings import OperatorSettings

# Registries of the kinds of handlers kopf retries. Webhooks are not among them: the API
# server's webhook timeout bounds each call, and kopf takes no `timeout=` or `backoff=`.
RETRIED = ("_activities", "_indexing", "_watching", "_spawning", "_changing")


def operator_registry() -> kopf.OperatorRegistry:
    nothing = cast(Any, None)
    shared = handlers.Shared(
        settings=OperatorSettings(webhook_url="https://127.0.0.1:9"),
        kube=nothing,
        agents=nothing,
        reconciler=nothing,
        events=nothing,
        template=cast(AgentTemplate, nothing),
        indexes=Indexes(),
    )
    return build_registry(shared, pod_watch=nothing, server=nothing)


def registered(registry: kopf.OperatorRegistry) -> list[Any]:
    found = []
    for part in RETRIED:
        found += list(getattr(registry, part).get_all_handlers())
    return found


def test_the_registry_has_every_kind_of_handler() -> None:
    registry = operator_registry()
    ids = {str(h.id) for h in registered(registry)}
    assert {"reconcile", "resync", "sources", "release"} <= ids
    assert len(list(registry._webhooks.get_all_handlers())) == 2


@pytest.mark.parametrize("handler", registered(operator_registry()), ids=lambda h: str(h.id))
def test_every_handler_has_its_timeout_and_backoff(handler: Any) -> None:
    assert handler.timeout == HANDLER_TIMEOUT_SECONDS
    assert handler.backoff == HANDLER_BACKOFF_SECONDS


def test_a_pass_deadline_leaves_the_handler_room_to_retry() -> None:
    # A reconcile call waits for the pass running when it came, then runs its own.
    assert 2 * PASS_TIMEOUT_SECONDS + HANDLER_BACKOFF_SECONDS < HANDLER_TIMEOUT_SECONDS


def test_a_delete_during_a_timer_call_waits_a_second_not_a_minute() -> None:
    """A WeightSync keeps kopf's finalizer while one of its timers runs (a resync pass
    during a round); kopf looks again after `background.cancellation_polling`, 60 s by
    default: a CI delete mid-round took 60 s. The operator's settings look every second."""
    from kopf._core.engines import daemons
    from kopf._core.intents import stoppers

    settings = kopf.OperatorSettings()
    configure_kopf(settings, OperatorSettings(webhook_url="https://127.0.0.1:9"), server=None)
    timer = next(h for h in registered(operator_registry()) if str(h.id) == "resync")

    async def stop_during_a_call() -> list[float]:
        running = asyncio.create_task(asyncio.sleep(30))  # the timer's call, not returned
        daemon = daemons.Daemon(
            task=running,
            logger=logging.getLogger(__name__),
            handler=timer,
            stopper=stoppers.DaemonStopper(),
        )
        try:
            return list(await daemons.stop_daemons(settings=settings, daemons={timer.id: daemon}))
        finally:
            running.cancel()

    assert asyncio.run(stop_during_a_call()) == [TIMER_EXIT_POLL_SECONDS]
    assert TIMER_EXIT_POLL_SECONDS <= 1.0
