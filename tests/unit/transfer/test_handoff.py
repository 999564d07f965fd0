"""Hand-off frames: typed JSON, length-prefixed, no pickle."""

from __future__ import annotations

import socket
import struct

import pytest

from weightsync.transfer.buffers import ShmSlotHandle, SlotHandles
from weightsync.transfer.handoff import (
    MAX_FRAME_BYTES,
    Abandon,
    Attach,
    Attached,
    Fill,
    Filled,
    HandoffError,
    ProtocolError,
    Publish,
    PublishResult,
    decode,
    encode,
    recv_message,
    send_message,
)

MESSAGES = [
    Attach(tensors=[("w", [2, 3], "bfloat16"), ("b", [], "float32")]),
    Attached(
        layout_hash="ab" * 32,
        bucket_size_bytes=1024,
        alignment=256,
        slots=SlotHandles(slots=[ShmSlotHandle(path="/dev/shm/x", nbytes=1024)]),
    ),
    Publish(version=3, lineage="a1b2", layout_hash="cd" * 32),
    Fill(bucket=4, slot=0),
    Filled(bucket=4),
    Abandon(reason="fill_failed", message="boom"),
    PublishResult(version=3, ok=False, duration_seconds=0.5, bytes=0, reason="timeout"),
    HandoffError(reason="layout_mismatch", message="attach again"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.type)
def test_round_trip_over_a_socket(message: object) -> None:
    left, right = socket.socketpair()
    with left, right:
        send_message(left, message)  # type: ignore[arg-type]
        assert recv_message(right) == message


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"type": "nope"}',
        b'{"type": "fill", "bucket": 1}',
        b'{"type": "filled", "bucket": 1, "x": 2}',
    ],
)
def test_invalid_messages_are_protocol_errors(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(body)


def test_oversized_frames_are_refused() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
        with pytest.raises(ProtocolError, match="exceeds"):
            recv_message(right)


def test_a_closed_peer_is_a_protocol_error() -> None:
    left, right = socket.socketpair()
    with right:
        left.sendall(encode(Filled(bucket=1))[:3])
        left.close()
        with pytest.raises(ProtocolError, match="closed"):
            recv_message(right)
