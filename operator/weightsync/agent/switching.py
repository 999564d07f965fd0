"""Which group generation a round runs on: the newest warm one, after telling older
ones to switch (their sinks follow the doorbell's notice), then retiring them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from weightsync.agent.doorbell import SwitchNotice, doorbell_key
from weightsync.agent.generations import Generation, Generations
from weightsync.agent.rounds import RoundFailed
from weightsync.api.control import GenerationState
from weightsync.api.reasons import FailureReason

log = logging.getLogger(__name__)

_SWITCH_NOTICE_SECONDS = 5.0  # the most a round waits to tell an old generation to switch


async def select_generation(generations: Generations, deadline: float) -> Generation:
    """The newest warm generation; older ones are told to switch, then retired.

    With none warm, waits until `deadline` for one: a plan being pre-warmed, or the
    generation the operator plans after a failed round broke the last one.
    """
    newest = generations.newest_usable()
    while newest is None and (left := deadline - time.monotonic()) > 0:
        async with generations.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(generations.changed.wait(), left)
        newest = generations.newest_usable()
    if newest is None:
        raise RoundFailed(FailureReason.NO_GROUP, "no warm group generation; waiting for a plan")
    for old in generations.all():
        if old.number < newest.number and old.state != GenerationState.RETIRED:
            await switch_away(old, newest.number)
    if newest.state != GenerationState.ACTIVE:
        newest.state = GenerationState.ACTIVE
    return newest


async def switch_away(old: Generation, target: int) -> None:
    """Ring `old`'s doorbell with a switch notice (its sinks follow), then retire it."""
    group = old.group
    if group is not None:
        key = doorbell_key(old.take_seq())
        notice = SwitchNotice(generation=target).model_dump_json()
        try:
            await asyncio.wait_for(
                group.run(lambda: group.ctl.set(key, notice)), _SWITCH_NOTICE_SECONDS
            )
        except (TimeoutError, RuntimeError) as exc:
            log.warning("could not tell generation %d to switch: %s", old.number, exc)
    old.retire()
