"""On-disk layout of the file backend: slot sizes and the self-verifying slot header.

A page of ``n`` bytes lives in a slot of ``round_up(512 + n, 512)`` bytes
(sector-aligned: a 64 KiB page costs 0.8% extra I/O, against 6% with 4 KiB
alignment): a 512-byte header followed by the payload. The header holds, little-endian:

======  ====  ===========================================================
offset  size  field
======  ====  ===========================================================
0       4     magic ``b"HCS1"`` (zeroed: a deleted, evicted or never-written slot)
4       2     format version (1)
6       2     key length in bytes (UTF-8)
8       4     flags (0; reserved)
12      8     sequence number (the newer copy of a key wins at start-up)
20      8     payload length in bytes
28      8     XXH3-64 of the payload
36      8     XXH3-64 of the 36 bytes above and the key
44      --    the key, then zeros up to 512 bytes
======  ====  ===========================================================

Slab files are named ``slab-<slot bytes>.dat``. Pure functions and constants: thread-safe.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence

import xxhash

from hicached.l3.framing import payload_checksum

__all__ = [
    "HEADER_BYTES",
    "MAX_KEY_BYTES",
    "MAX_SEQ",
    "SLAB_NAME",
    "SLOT_ALIGN",
    "TOMBSTONE",
    "ZEROS",
    "header_matches",
    "pack_header",
    "parse_header",
    "slot_bytes_for",
]

SLOT_ALIGN = 512
HEADER_BYTES = 512
MAGIC = b"HCS1"
VERSION = 1
# magic, version, key_len, flags, seq, payload_len, payload_checksum
_FIXED = struct.Struct("<4sHHIQQQ")
_HCHECK = struct.Struct("<Q")
_KEY_OFFSET = _FIXED.size + _HCHECK.size
MAX_KEY_BYTES = HEADER_BYTES - _KEY_OFFSET
# The highest sequence number a header may carry. Numbers grow by one per page written, from the
# highest found at start, so a store never comes near it; a header above it (damaged, or written
# by another program) would leave the next numbers no room in the 64-bit field, and every later
# write would fail to pack its header. One at or just under it is renumbered at start
# (hicached.l3.file.index.RENUMBER_ABOVE), or the numbers after it would pass this bound.
MAX_SEQ = (1 << 63) - 1
SLAB_NAME = re.compile(r"^slab-(\d+)\.dat$")
# Zero padding between a page's payload and the next slot, and what clears a slot header.
ZEROS = memoryview(bytes(SLOT_ALIGN))
TOMBSTONE = bytes(len(MAGIC))


def slot_bytes_for(payload_len: int) -> int:
    """The slot size of a page of ``payload_len`` bytes (header included, sector-aligned)."""
    return -(-(HEADER_BYTES + payload_len) // SLOT_ALIGN) * SLOT_ALIGN


def pack_header(key_bytes: bytes, seq: int, length: int, checksum: int) -> bytes:
    """The 512-byte header of a page (``key_bytes`` at most :data:`MAX_KEY_BYTES`)."""
    fixed = _FIXED.pack(MAGIC, VERSION, len(key_bytes), 0, seq, length, checksum)
    hcheck = xxhash.xxh3_64_intdigest(fixed + key_bytes)
    head = fixed + _HCHECK.pack(hcheck) + key_bytes
    return head + bytes(HEADER_BYTES - len(head))


def parse_header(buf: bytes | bytearray | memoryview) -> tuple[str, int, int, int] | None:
    """(key, seq, payload_len, payload_checksum) of a valid header, else None (a sequence
    number above :data:`MAX_SEQ` is not valid)."""
    view = memoryview(buf)
    if view.nbytes < HEADER_BYTES:
        return None
    magic, version, key_len, _flags, seq, length, checksum = _FIXED.unpack_from(view)
    if magic != MAGIC or version != VERSION or key_len > MAX_KEY_BYTES or seq > MAX_SEQ:
        return None
    key_bytes = bytes(view[_KEY_OFFSET : _KEY_OFFSET + key_len])
    (hcheck,) = _HCHECK.unpack_from(view, _FIXED.size)
    if hcheck != xxhash.xxh3_64_intdigest(bytes(view[: _FIXED.size]) + key_bytes):
        return None
    try:
        return key_bytes.decode("utf-8"), seq, length, checksum
    except UnicodeDecodeError:
        return None


def header_matches(
    header: bytes | bytearray | memoryview,
    chunks: Sequence[memoryview],
    *,
    key: str,
    seq: int,
    length: int,
    checksum: int,
) -> bool:
    """Whether ``header`` and the payload in ``chunks`` are the page the index expects.

    The index holds every header field, so an exact field comparison verifies the
    header without rehashing it (the start-up scan does); the payload is hashed.
    """
    raw = key.encode("utf-8")
    return (
        header[: _FIXED.size] == _FIXED.pack(MAGIC, VERSION, len(raw), 0, seq, length, checksum)
        and header[_KEY_OFFSET : _KEY_OFFSET + len(raw)] == raw
        and payload_checksum(chunks) == checksum
    )
