"""The source agent's Unix socket for the trainer's Publisher (see transfer.handoff)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from weightsync.agent.rounds import RoundFailed
from weightsync.api.reasons import FailureReason
from weightsync.transfer.buffers import SlotError, SlotHandles
from weightsync.transfer.handoff import (
    Abandon,
    Attach,
    Attached,
    Fence,
    Fill,
    Filled,
    HandoffError,
    Pieces,
    ProtocolError,
    Publish,
    Release,
    read_message,
    write_message,
)
from weightsync.transfer.layout import LayoutError, TensorMeta

if TYPE_CHECKING:
    from weightsync.agent.source_loop import SourceLoop

log = logging.getLogger(__name__)


class SocketFillChannel:
    """Asks the Publisher to fill one bucket and waits for its `Filled`."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._timeout = timeout

    async def fill(
        self,
        bucket: int,
        slot: int,
        pieces: Pieces | None = None,
        slots: SlotHandles | None = None,
    ) -> None:
        fill = Fill(bucket=bucket, slot=slot, pieces=pieces, slots=slots)
        try:
            await write_message(self._writer, fill)
            reply = await asyncio.wait_for(read_message(self._reader), self._timeout)
        except (ProtocolError, ConnectionError) as exc:
            raise RoundFailed(
                FailureReason.PUBLISHER_GONE, f"the Publisher went away: {exc}"
            ) from exc
        except TimeoutError as exc:
            raise RoundFailed(
                FailureReason.PUBLISHER_TIMEOUT, f"bucket {bucket} was not filled"
            ) from exc
        if isinstance(reply, Abandon):
            raise RoundFailed(FailureReason.PUBLISHER_ABANDONED, f"{reply.reason}: {reply.message}")
        if not isinstance(reply, Filled) or reply.bucket != bucket:
            raise RoundFailed(
                FailureReason.PUBLISHER_PROTOCOL, f"expected Filled({bucket}), got {reply!r}"
            )


async def _attach(source: SourceLoop, message: Attach) -> Attached | HandoffError:
    try:
        metas = [TensorMeta(n, tuple(s), d) for n, s, d in message.tensors]
        return await source.attach(metas, message.sources, message.boxes)
    except (LayoutError, RoundFailed, SlotError) as exc:
        reason: str = (
            FailureReason.BAD_LAYOUT
            if isinstance(exc, LayoutError)
            else FailureReason.SLOTS_UNAVAILABLE
        )
        if isinstance(exc, RoundFailed):
            reason = exc.reason
        return HandoffError(reason=reason, message=str(exc))


async def serve_publisher(
    source: SourceLoop, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """One Publisher connection: Attach and Publish requests until it closes."""
    try:
        while True:
            try:
                message = await read_message(reader)
            except (ProtocolError, ConnectionError):
                await source.publisher_left()
                return
            if isinstance(message, Attach):
                await write_message(writer, await _attach(source, message))
            elif isinstance(message, Publish):
                result = await source.publish(
                    message, SocketFillChannel(reader, writer, source.fill_timeout)
                )
                await write_message(writer, result)
            elif isinstance(message, Fence):
                await write_message(writer, await source.fence(message.version, message.clean))
            elif isinstance(message, Release):
                try:
                    await write_message(writer, await source.release())
                except RoundFailed as exc:  # the engine refused: the trainer is told why
                    await write_message(writer, HandoffError(reason=exc.reason, message=str(exc)))
            else:
                await write_message(
                    writer,
                    HandoffError(
                        reason=FailureReason.PROTOCOL, message=f"unexpected {message.type!r}"
                    ),
                )
    except (ConnectionError, ProtocolError) as exc:
        log.info("Publisher connection closed: %s", exc)
        await source.publisher_left()
    except asyncio.CancelledError:
        # The agent is shutting down. asyncio's start_unix_server asks a cancelled
        # connection task for its exception and logs a traceback unless the handler ends
        # normally; the connection is closed below either way.
        log.info("Publisher connection closed: the agent is stopping")
    finally:
        writer.close()
