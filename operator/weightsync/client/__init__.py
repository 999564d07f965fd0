"""weightsync.client: the trainer-side Publisher."""

from weightsync.client.connection import (
    AgentUnavailableError,
    LayoutChangedError,
    PublisherError,
)
from weightsync.client.inputs import PublishInputError
from weightsync.client.publisher import Publisher
from weightsync.transfer.handoff import PublishResult

__all__ = [
    "AgentUnavailableError",
    "LayoutChangedError",
    "PublishInputError",
    "PublishResult",
    "Publisher",
    "PublisherError",
]
