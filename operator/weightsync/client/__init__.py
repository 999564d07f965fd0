"""weightsync.client: the trainer-side Publisher."""

from weightsync.client.inputs import PublishInputError
from weightsync.client.publisher import (
    AgentUnavailableError,
    LayoutChangedError,
    Publisher,
    PublisherError,
)
from weightsync.transfer.handoff import PublishResult

__all__ = [
    "AgentUnavailableError",
    "LayoutChangedError",
    "PublishInputError",
    "PublishResult",
    "Publisher",
    "PublisherError",
]
