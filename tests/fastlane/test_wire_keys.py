"""The key section of a lane record, encoded by the client and decoded by the daemon, without
a daemon: ASCII keys (one decode, then slices) and other UTF-8 keys (decoded one by one)."""

from __future__ import annotations

import pytest
from hicached_client import lane_wire as w


@pytest.mark.parametrize(
    "keys",
    [
        ("0f3a", "b", "c.swa@t" * 20),
        ("é", "a", "中文/key", ""),
        ("", ""),
        (),
        tuple(f"{i:064x}" for i in range(128)),
    ],
    ids=["ascii", "utf-8", "empty keys", "no keys", "a batch of digests"],
)
def test_keys_come_back_as_sent(keys: tuple[str, ...]) -> None:
    ring = memoryview(bytearray(w.RING_BYTES))
    w.init_ring(ring)
    sent = w.Request(w.Opcode.GET_PAGES, 0, 0, "op-1", (), keys)
    w.encode_request(ring, w.request_offset(0), sent)
    assert w.read_request(ring, w.request_offset(0)).keys == keys


@pytest.mark.parametrize("key", ["k" * 65536, "é" * 32768], ids=["ascii", "two bytes a character"])
def test_a_key_over_65535_utf8_bytes_is_refused_before_the_keys_are_written(key: str) -> None:
    """Lengths are UTF-8 bytes, not characters: 32,768 'é' are 65,536 bytes and do not fit."""
    ring = memoryview(bytearray(w.RING_BYTES))
    w.init_ring(ring)
    before = bytes(ring[w.request_offset(0) + w.REQUEST.size :][:64])
    with pytest.raises(ValueError, match="65535 UTF-8 bytes"):
        w.encode_request(ring, w.request_offset(0), w.Request(w.Opcode.LOOKUP, 0, 0, "op-1", (), ("a", key)))
    assert bytes(ring[w.request_offset(0) + w.REQUEST.size :][:64]) == before
