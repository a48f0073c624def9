"""A completion's message, encoded by the daemon and decoded by the client, without a daemon:
one longer than the record's 256-byte field goes on after the sections and comes back whole."""

from __future__ import annotations

import numpy as np
import pytest
from hicached_client import lane_wire as w

TRANSFER = w.WireTransfer("kv", np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int64), True)


@pytest.mark.parametrize(
    ("message", "sections"),
    [
        ("short", False),
        ("x" * 5000, False),
        ("naïve " * 700, False),  # a two-byte character across the field's end
        ("中文" * 900, True),  # after transfers, acks and layers
    ],
    ids=["short", "ascii", "split character", "after the sections"],
)
def test_a_message_comes_back_whole(message: str, sections: bool) -> None:
    ring = memoryview(bytearray(w.RING_BYTES))
    w.init_ring(ring)
    done = w.Completion(
        int(w.Opcode.WRITE), 0, 3, False, 25, message,
        (TRANSFER,) if sections else (), (w.WireAck("kv", 3, 3, 4096),) if sections else (),
        (0, 1) if sections else (),
    )  # fmt: skip
    w.encode_completion(ring, w.completion_offset(0), done)
    got = w.read_completion(ring, w.completion_offset(0))
    assert got.message == message
    assert (got.status, got.retry_after_ms, got.acks, got.layers) == (3, 25, done.acks, done.layers)
    # A reader of the fixed field alone (a client before the tail) gets the first 256 bytes.
    fixed = w.COMPLETION.unpack_from(ring, w.completion_offset(0))[-1]
    assert fixed.rstrip(b"\0") == message.encode()[: w.MESSAGE_BYTES]


def test_a_message_over_the_wire_limit_is_cut_there() -> None:
    ring = memoryview(bytearray(w.RING_BYTES))
    w.init_ring(ring)
    w.encode_completion(ring, w.completion_offset(0), w.Completion(1, 0, 3, False, None, "y" * 20_000))
    assert w.read_completion(ring, w.completion_offset(0)).message == "y" * w.MAX_MESSAGE_BYTES
