"""Self-verifying page frames shared by the remote L3 backends (redis, s3, mooncake).

Two frame versions, told apart by the version field; a backend writes one of
them and refuses the other as it refuses a corrupt frame (a miss).

Version 1, *plain* (no ``l3.auth_key_file``): a 32-byte header, then the payload.

======  ====  ===========================================================
offset  size  field (little-endian)
======  ====  ===========================================================
0       4     magic ``b"HCP1"``
4       2     format version (1)
6       2     flags (0; reserved)
8       8     payload length in bytes
16      8     XXH3-64 of the key (UTF-8) -- catches a value stored under
              the wrong key
24      8     XXH3-64 of the payload
======  ====  ===========================================================

Both hashes are unkeyed: they catch corruption, not a writer. Anyone who can
write the shared store can compute a valid version-1 frame of any bytes under
any key.

Version 2, *authenticated* (``l3.auth_key_file`` set): a 48-byte header, then
the payload.

======  ====  ===========================================================
0       4     magic ``b"HCP1"``
4       2     format version (2)
6       2     flags (0; reserved)
8       8     payload length in bytes
16      32    HMAC-SHA256 (the frame key of :class:`L3Key`) over the first
              16 header bytes, the key's UTF-8 length (u32 LE) and bytes,
              then the payload
======  ====  ===========================================================

The MAC binds the bytes to their object key (the backend's key: namespace,
pool, content key and tenant tag), so a frame is valid only where a holder of
the secret put it; it replaces both XXH3s (it catches corruption as well).
HMAC-SHA256 was measured against keyed BLAKE2b on a 2-core VM with SHA-NI
(1 MiB buffers): 1.1 GB/s against 0.6 GB/s (XXH3: ~48 GB/s). hashlib releases
the GIL while it hashes, so the L3 I/O threads MAC in parallel.

Every comparison of a MAC is constant-time (:func:`hmac.compare_digest`).
Pure functions and immutable objects: thread-safe.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "AUTH_HEADER",
    "FRAME_HEADER",
    "FRAME_MAGIC",
    "KEY_MIN_BYTES",
    "PLAIN",
    "FrameCodec",
    "L3Key",
    "frame",
    "key_hash",
    "pack_header",
    "payload_checksum",
    "unframe",
]

FRAME_MAGIC = b"HCP1"
FRAME_VERSION = 1
AUTH_VERSION = 2
FRAME_HEADER = struct.Struct("<4sHHQQQ")  # version 1
AUTH_HEADER = struct.Struct("<4sHHQ32s")  # version 2
_COMMON = struct.Struct("<4sHHQ")  # the fields both versions start with
_KEY_LEN = struct.Struct("<I")
# The secret's shortest length: 256 bits, HMAC-SHA256's own strength.
KEY_MIN_BYTES = 32

Buffer = bytes | bytearray | memoryview


def payload_checksum(chunks: Sequence[Buffer]) -> int:
    """XXH3-64 of the concatenation of ``chunks`` (no concatenation is made)."""
    if len(chunks) == 1:
        return int(xxhash.xxh3_64_intdigest(chunks[0]))
    hasher = xxhash.xxh3_64()
    for chunk in chunks:
        hasher.update(chunk)
    return int(hasher.intdigest())


def key_hash(key: str) -> int:
    return int(xxhash.xxh3_64_intdigest(key.encode("utf-8")))


def pack_header(key: str, payload_len: int, checksum: int) -> bytes:
    """A version-1 (plain) header."""
    return FRAME_HEADER.pack(FRAME_MAGIC, FRAME_VERSION, 0, payload_len, key_hash(key), checksum)


@dataclass(frozen=True, repr=False)
class L3Key:
    """The keys derived from ``l3.auth_key_file``'s secret: one MACs frames, one tags tenants.

    Derived with HMAC-SHA256 as a PRF over distinct labels, so the secret itself is used
    for nothing else and neither key tells anything of the other. ``repr`` hides them.
    Immutable: thread-safe.
    """

    frame_key: bytes
    tenant_key: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> L3Key:
        if len(secret) < KEY_MIN_BYTES:
            raise ValueError(f"an L3 secret must be at least {KEY_MIN_BYTES} bytes, got {len(secret)}")
        return cls(
            frame_key=hmac.digest(secret, b"hicached l3 frame mac v2", "sha256"),
            tenant_key=hmac.digest(secret, b"hicached l3 tenant tag v1", "sha256"),
        )

    def __repr__(self) -> str:
        return "L3Key(<secret>)"


def _mac(mac_key: bytes, common: bytes, key: bytes, chunks: Sequence[Buffer]) -> bytes:
    hasher = hmac.new(mac_key, common, "sha256")
    hasher.update(_KEY_LEN.pack(len(key)))
    hasher.update(key)
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.digest()


class FrameCodec:
    """Writes and verifies the frames of one backend: version 2 with a frame key, else 1.

    Immutable after construction; every method is pure, so one codec is shared by all the
    backend's threads.
    """

    __slots__ = ("_mac_key",)

    def __init__(self, mac_key: bytes | None = None) -> None:
        self._mac_key = mac_key

    def __repr__(self) -> str:
        return f"FrameCodec({'authenticated' if self._mac_key else 'plain'})"

    @property
    def header_size(self) -> int:
        """Bytes a frame adds to its payload."""
        return AUTH_HEADER.size if self._mac_key is not None else FRAME_HEADER.size

    def header(self, key: str, chunks: Sequence[Buffer]) -> bytes:
        """The header of ``key``'s frame of the concatenation of ``chunks`` (read once)."""
        length = sum(memoryview(c).nbytes for c in chunks)
        if self._mac_key is None:
            return pack_header(key, length, payload_checksum(chunks))
        common = _COMMON.pack(FRAME_MAGIC, AUTH_VERSION, 0, length)
        return common + _mac(self._mac_key, common, key.encode("utf-8"), chunks)

    def frame(self, key: str, chunks: Sequence[Buffer]) -> bytes:
        """Header + payload as one new bytes object (one copy of the payload)."""
        return b"".join([self.header(key, chunks), *chunks])

    def foreign(self, blob: Buffer) -> str:
        """Why ``blob`` can never verify here if it is a frame of the other version (a
        daemon with the other ``l3.auth_key_file`` setting wrote it), else "". Reads only
        the header, so it is cheap enough for the log of a value of any size."""
        view = memoryview(blob)
        if view.nbytes < _COMMON.size:
            return ""
        magic, version, _flags, _length = _COMMON.unpack_from(view)
        if magic != FRAME_MAGIC:
            return ""
        if version == AUTH_VERSION and self._mac_key is None:
            return "an authenticated frame (version 2) but this daemon has no l3.auth_key_file"
        if version == FRAME_VERSION and self._mac_key is not None:
            return "an unauthenticated frame (version 1) but this daemon has l3.auth_key_file"
        return ""

    def verify(self, key: str, blob: Buffer) -> tuple[memoryview | None, str]:
        """(the verified payload, a view into ``blob``; "") or (None, why it was refused).

        Refused: truncated or malformed, the other version than this codec writes, stored
        under another key, or not matching its checksum / MAC. ``why`` is for the log (the
        key is the caller's to add)."""
        view = memoryview(blob)
        if view.nbytes < _COMMON.size:
            return None, f"{view.nbytes} bytes, shorter than a frame header"
        magic, version, _flags, length = _COMMON.unpack_from(view)
        if magic != FRAME_MAGIC:
            return None, "not a frame (bad magic)"
        if foreign := self.foreign(view):
            return None, foreign
        if version not in (FRAME_VERSION, AUTH_VERSION):
            return None, f"unknown frame version {version}"
        size = AUTH_HEADER.size if version == AUTH_VERSION else FRAME_HEADER.size
        if view.nbytes != size + length:
            return None, f"{view.nbytes} bytes, but its header says {size + length}"
        payload = view[size:]
        if self._mac_key is None:
            _m, _v, _f, _n, khash, checksum = FRAME_HEADER.unpack_from(view)
            if khash != key_hash(key):
                return None, "stored under another key"
            if payload_checksum([payload]) != checksum:
                return None, "payload checksum mismatch"
            return payload, ""
        common = view[: _COMMON.size].tobytes()
        expected = _mac(self._mac_key, common, key.encode("utf-8"), [payload])
        if not hmac.compare_digest(expected, view[_COMMON.size : size]):
            return None, "MAC mismatch (forged, damaged, or written with another l3.auth_key_file)"
        return payload, ""

    def unframe(self, key: str, blob: Buffer) -> memoryview | None:
        """The verified payload of ``blob`` (a view into it), or ``None`` (see :meth:`verify`)."""
        return self.verify(key, blob)[0]


PLAIN = FrameCodec()


def frame(key: str, chunks: Sequence[Buffer]) -> bytes:
    """A version-1 (plain) frame: header + payload as one new bytes object."""
    return PLAIN.frame(key, chunks)


def unframe(key: str, blob: Buffer) -> memoryview | None:
    """The verified payload of a version-1 (plain) frame, or ``None`` (see :meth:`FrameCodec.verify`)."""
    return PLAIN.unframe(key, blob)
