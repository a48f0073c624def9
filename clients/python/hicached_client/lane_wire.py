"""The fast lane's wire format, version 1: ring memory layout and binary records.

Shared by the daemon (``hicached.server.fastlane``) and the client
(``hicached_client.fastlane``); docs/fastlane.md is the prose version. Everything
is little-endian and fixed-size except the page arrays, whose lengths the
record's descriptors give. Nothing is pickled.

Ring memory (one sealed memfd per lane, :data:`RING_BYTES` long)::

    0      u32 magic 'HCFL', u16 version, u16 0, u32 slots, u32 area, u32 max_layers
    64     u64 sq_tail   requests published (written by the client)
    128    u64 sq_head   requests taken (written by the daemon)
    192    u64 cq_tail   completions published (written by the daemon)
    4096   u64 layer_seq[max_layers]  seq of the last Load whose layer l landed
    +8*L   u64 layer_ns[max_layers]   CLOCK_MONOTONIC ns when it landed
    SLOTS_OFFSET + i * 2 * area        request slot i
    SLOTS_OFFSET + i * 2 * area + area completion slot i

Request ``seq`` (0, 1, 2, ...) lives in slot ``seq % slots``; its completion in the
completion slot of the same index. The client keeps at most ``slots`` requests
unanswered. Request record::

    REQUEST  <I H H I I Q 32s>   magic 'HCRQ', version, opcode, flags, ntransfers, seq, op_id
    TRANSFER <64s I I I I> x n   pool (utf-8, NUL padded), ndevice, nhost, tflags, reserved=0
    int64 pages                  per transfer: its device pages, then its host pages
    KEYS <I> + <H> x n + bytes   GetPages/PutPages/Lookup only: key count, each key's UTF-8 length,
                                 then the keys' bytes back to back

Completion record::

    COMPLETION <I H H Q I I i I I I Q I 256s>  magic 'HCCQ', version, opcode, seq, status (gRPC
               code number), ok, retry_after_ms (-1 = none), ntransfers, nacks, nlayers, value,
               message length (utf-8 bytes, at most MAX_MESSAGE_BYTES), message (its first 256
               bytes, NUL padded)
    TRANSFER + pages x ntransfers (as in a request), ACK <64s Q Q Q> x nacks (pool, pages, tokens,
    bytes), int32 layers x nlayers (a Load's layers in the order they landed), then the
    message's bytes past the first 256: an error's message is gRPC's whole message (a reader
    of the fixed field only reads its first 256 bytes, all that older daemons sent)

``value`` is a Release's freed pages, a GetPages' hit pages and a PutPages' stored pages (its
existing pages are the keys not stored when ``ok``, else 0, as the core counts them); a
Lookup's L2 leading run in the high 32 bits and its L2-or-L3 leading run in the low 32.

Thread-safety: pure functions over buffers the caller owns.
"""

from __future__ import annotations

import itertools
import operator
import re
import struct
import sys
from array import array
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np

NEGOTIATE_MAGIC = b"hicached-lane-v1"
SUFFIX = ".lane"
VERSION = 1
RING_MAGIC = 0x4C464348  # b"HCFL"
REQUEST_MAGIC = 0x51524348  # b"HCRQ"
COMPLETION_MAGIC = 0x51434348  # b"HCCQ"

SLOTS = 4
AREA = 1 << 20  # bytes of one request or one completion record
MAX_LAYERS = 1024
MAX_TRANSFERS = 64
MAX_NEGOTIATE = 512
MESSAGE_BYTES = 256  # the completion's fixed message field
# A whole message at most (the fixed field and the tail after the sections): above the
# daemon's error messages (1,024 characters, at most 4 UTF-8 bytes each, and the length said).
MAX_MESSAGE_BYTES = 8192
POOL_NAME_BYTES = 64

RING_HEADER = struct.Struct("<IHHIII")
SQ_TAIL, SQ_HEAD, CQ_TAIL = 64, 128, 192
LAYER_SEQ = 4096
LAYER_NS = LAYER_SEQ + 8 * MAX_LAYERS
SLOTS_OFFSET = 32768
RING_BYTES = SLOTS_OFFSET + SLOTS * 2 * AREA

REQUEST = struct.Struct("<IHHII Q 32s")
KEY_COUNT = struct.Struct("<I")
TRANSFER = struct.Struct("<64sIIII")
COMPLETION = struct.Struct("<IHHQIIiIIIQI256s")
ACK = struct.Struct("<64sQQQ")

FLAG_ALLOCATE = 1
FLAG_LAYER_PROGRESS = 2
FLAG_INCLUDE_L3 = 4  # GetPages: fetch what L2 lacks from L3
KNOWN_FLAGS = FLAG_ALLOCATE | FLAG_LAYER_PROGRESS | FLAG_INCLUDE_L3
T_HAS_HOST = 1
T_HOST_ALLOCATED = 2
KNOWN_TFLAGS = T_HAS_HOST | T_HOST_ALLOCATED
PRINTABLE_OP_ID = re.compile(rb"[\x21-\x7e]*")  # what a record's op_id field may hold
MAX_PAGES = (AREA - REQUEST.size - MAX_TRANSFERS * TRANSFER.size) // 8


class Opcode(IntEnum):
    WRITE = 1
    LOAD = 2
    RESOLVE = 3
    RELEASE = 4
    PING = 5  # no work: measures the lane itself
    GET_PAGES = 6  # keyed: added in v1 (an older daemon answers UNIMPLEMENTED)
    PUT_PAGES = 7
    LOOKUP = 8  # keyed, no transfers: added in v1 after GET_PAGES (older daemons: UNIMPLEMENTED)


KEYED = frozenset({Opcode.GET_PAGES, Opcode.PUT_PAGES, Opcode.LOOKUP})
_OPCODES = {int(o): o for o in Opcode}
# LOOKUP answers two counts in the completion's one value field: L2 hits in the high 32 bits,
# L2-or-L3 hits in the low 32 (each at most the record's key count, far below 2**32).
LOOKUP_SHIFT = 32
_LOOKUP_TRANSFERS = "a LOOKUP record carries keys only, no transfers"


def lookup_value(l2_hit_pages: int, total_hit_pages: int) -> int:
    return (l2_hit_pages << LOOKUP_SHIFT) | total_hit_pages


def lookup_counts(value: int) -> tuple[int, int]:
    """(l2_hit_pages, total_hit_pages) of a LOOKUP completion's value."""
    return value >> LOOKUP_SHIFT, value & ((1 << LOOKUP_SHIFT) - 1)


# The flags each opcode takes; any other bit is refused, never ignored.
OPCODE_FLAGS = {
    Opcode.WRITE: FLAG_ALLOCATE,
    Opcode.LOAD: FLAG_LAYER_PROGRESS,
    Opcode.GET_PAGES: FLAG_INCLUDE_L3,
}


class RecordError(Exception):
    """A record that is not a valid v1 record; ``code`` is the gRPC status name to answer with."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class WireTransfer:
    """One pool's pages in a record; ``host`` None = no host pages given (allocate)."""

    pool: str
    device: np.ndarray | None
    host: np.ndarray | None
    host_allocated: bool = False


# Request and Completion are tuples, not frozen dataclasses: four are built per round trip,
# and a tuple of ten fields costs 0.6 us to build against 1.5 us.
class Request(NamedTuple):
    opcode: Opcode
    flags: int
    seq: int
    op_id: str
    transfers: tuple[WireTransfer, ...]
    keys: tuple[str, ...] = ()  # GetPages/PutPages/Lookup only


@dataclass(frozen=True)
class WireAck:
    pool: str
    pages: int
    tokens: int
    bytes: int


class Completion(NamedTuple):
    opcode: int
    seq: int
    status: int  # gRPC status code number; 0 = OK
    ok: bool
    retry_after_ms: int | None
    message: str
    transfers: tuple[WireTransfer, ...] = ()
    acks: tuple[WireAck, ...] = ()
    layers: tuple[int, ...] = ()
    value: int = 0


def request_offset(seq: int) -> int:
    return SLOTS_OFFSET + (seq % SLOTS) * 2 * AREA


def completion_offset(seq: int) -> int:
    return request_offset(seq) + AREA


def _name(raw: bytes, what: str) -> str:
    text = raw.rstrip(b"\0")
    if b"\0" in text:
        raise RecordError(f"{what} has a NUL inside the name")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError(f"{what} is not UTF-8 (starts {text[:16]!r})") from None


def _pack_name(name: str, size: int, what: str) -> bytes:
    raw = name.encode("utf-8")
    if len(raw) > size or b"\0" in raw:
        raise ValueError(f"{what} {name[:32]!r} must be at most {size} UTF-8 bytes without NUL")
    return raw


def _pages(values: object, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    return arr


# ---------------------------------------------------------------- transfers (both records)


def _write_transfers(buf: memoryview, pos: int, transfers: tuple[WireTransfer, ...], limit: int) -> int:
    arrays: list[np.ndarray] = []
    for i, t in enumerate(transfers):
        dev = np.empty(0, np.int64) if t.device is None else _pages(t.device, f"transfers[{i}].device")
        host = None if t.host is None else _pages(t.host, f"transfers[{i}].host")
        tflags = (T_HAS_HOST if host is not None else 0) | (T_HOST_ALLOCATED if t.host_allocated else 0)
        nhost = 0 if host is None else len(host)
        TRANSFER.pack_into(buf, pos, _pack_name(t.pool, POOL_NAME_BYTES, "pool"), len(dev), nhost, tflags, 0)
        pos += TRANSFER.size
        arrays.append(dev)
        if host is not None:
            arrays.append(host)
    total = sum(len(a) for a in arrays) * 8
    if pos + total > limit:
        raise ValueError(f"{total // 8} page indices do not fit in a lane record (at most {MAX_PAGES})")
    for a in arrays:
        n = len(a) * 8
        buf[pos : pos + n] = a.astype("<i8", copy=False).tobytes()
        pos += n
    return pos


def _read_transfers(
    buf: bytes | memoryview, pos: int, count: int, limit: int
) -> tuple[tuple[WireTransfer, ...], int]:
    """Decode ``count`` transfers from a private copy; every field is checked (hostile input)."""
    heads = []
    for i in range(count):
        if pos + TRANSFER.size > limit:
            raise RecordError(f"record ends inside transfers[{i}]")
        raw, ndev, nhost, tflags, reserved = TRANSFER.unpack_from(buf, pos)
        pos += TRANSFER.size
        what = f"transfers[{i}]"
        if tflags & ~KNOWN_TFLAGS or reserved:
            raise RecordError(f"{what}: unknown flag bits {tflags:#x} / reserved {reserved:#x} (must be 0)")
        if not tflags & T_HAS_HOST and nhost:
            raise RecordError(f"{what}: {nhost} host pages without the has-host flag")
        heads.append((_name(raw, f"{what}.pool"), ndev, nhost, tflags))
    total = sum(h[1] + h[2] for h in heads)
    if total > MAX_PAGES or pos + 8 * total > limit:
        raise RecordError(
            f"record claims {total} page indices, more than fit in one lane record "
            f"({MAX_PAGES}); split the batch or use gRPC",
        )
    # One private native copy of every index, sliced per transfer (two numpy calls per
    # record instead of two per list).
    pages = np.frombuffer(buf, dtype="<i8", count=total, offset=pos).astype(np.int64)
    at = 0
    out = []
    for name, ndev, nhost, tflags in heads:
        dev = pages[at : at + ndev]
        at += ndev
        host = None
        if tflags & T_HAS_HOST:
            host = pages[at : at + nhost]
            at += nhost
        out.append(WireTransfer(name, dev, host, bool(tflags & T_HOST_ALLOCATED)))
    return tuple(out), pos + 8 * total


# ---------------------------------------------------------------- requests


def encode_request(buf: memoryview, offset: int, req: Request) -> None:
    """Write ``req`` at ``offset`` of the ring (the client's side). ValueError when it cannot fit."""
    if len(req.transfers) > MAX_TRANSFERS:
        raise ValueError(f"{len(req.transfers)} transfers in one lane record (at most {MAX_TRANSFERS})")
    op = req.op_id.encode("ascii")
    if len(op) > 32:
        raise ValueError(f"op_id {req.op_id[:40]!r} is longer than 32 ASCII characters")
    if req.keys and req.opcode not in KEYED:
        raise ValueError(f"{req.opcode.name} carries no keys")
    if req.transfers and req.opcode is Opcode.LOOKUP:
        raise ValueError(_LOOKUP_TRANSFERS)
    REQUEST.pack_into(
        buf, offset, REQUEST_MAGIC, VERSION, int(req.opcode), req.flags, len(req.transfers), req.seq, op
    )
    pos = offset + REQUEST.size
    if req.transfers:
        pos = _write_transfers(buf, pos, req.transfers, offset + AREA)
    if req.opcode in KEYED:
        _write_keys(buf, pos, req.keys, offset + AREA)


def _write_keys(buf: memoryview, pos: int, keys: tuple[str, ...], limit: int) -> None:
    text = "".join(keys)
    blob = text.encode("utf-8")
    # ASCII keys (the common case): a character is a byte, so the lengths need no encoding.
    sizes = list(map(len, keys)) if len(blob) == len(text) else [len(k.encode("utf-8")) for k in keys]
    if sizes and max(sizes) > 0xFFFF:
        raise ValueError("a key longer than 65535 UTF-8 bytes does not fit a lane record")
    counts = array("H", sizes)
    if sys.byteorder != "little":
        counts.byteswap()
    lengths = counts.tobytes()
    end = pos + KEY_COUNT.size + len(lengths) + len(blob)
    if end > limit:
        raise ValueError(f"{len(keys)} keys ({len(blob)} bytes) do not fit in a lane record: use gRPC")
    KEY_COUNT.pack_into(buf, pos, len(keys))
    pos += KEY_COUNT.size
    buf[pos : pos + len(lengths)] = lengths
    pos += len(lengths)
    buf[pos:end] = blob


def _read_keys(ring: memoryview, pos: int, limit: int, max_keys: int | None) -> tuple[str, ...]:
    """The keys section at ``pos``, copied out of the ring once and checked (hostile input)."""
    if pos + KEY_COUNT.size > limit:
        raise RecordError("record ends before its key count")
    (count,) = KEY_COUNT.unpack(bytes(ring[pos : pos + KEY_COUNT.size]))
    pos += KEY_COUNT.size
    if pos + 2 * count > limit:
        raise RecordError(f"record claims {count} keys, more than fit in one lane record")
    if max_keys is not None and count > max_keys:  # before decoding any of them
        raise RecordError(
            f"keys in this request: {count} exceeds limits.max_keys_per_request={max_keys}",
            "RESOURCE_EXHAUSTED",
        )
    # Python's own array and accumulate: a few numpy calls cost more than these 128 numbers.
    lengths = array("H", bytes(ring[pos : pos + 2 * count]))
    if sys.byteorder != "little":
        lengths.byteswap()
    pos += 2 * count
    bounds = list(itertools.accumulate(lengths, initial=0))  # where each key starts, then the end
    total = bounds[-1]
    if pos + total > limit:
        raise RecordError(f"record claims {total} bytes of keys, more than fit in one lane record")
    blob = bytes(ring[pos : pos + total])
    if blob.isascii():  # the common case: one decode, then slices (a byte is a character)
        text = blob.decode("ascii")
        # Slices made by map in C: a generator's frame per key took half again as long.
        return tuple(map(operator.getitem, itertools.repeat(text), map(slice, bounds, bounds[1:])))
    out = []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        try:
            out.append(blob[start:end].decode("utf-8"))
        except UnicodeDecodeError:
            raise RecordError(f"keys[{i}] is not UTF-8 (starts {blob[start : start + 16]!r})") from None
    return tuple(out)


def read_request(ring: memoryview, offset: int, *, max_keys: int | None = None) -> Request:
    """Copy the request at ``offset`` out of shared memory ONCE and decode the copy.

    The client can change the ring at any moment, so nothing is parsed in place.
    Raises :class:`RecordError` for anything that is not a valid v1 request, and
    (RESOURCE_EXHAUSTED) for more than ``max_keys`` keys, before decoding them.
    """
    head = bytes(ring[offset : offset + REQUEST.size])
    magic, version, opcode, flags, count, seq, op_raw = REQUEST.unpack(head)
    if magic != REQUEST_MAGIC:
        raise RecordError(f"not a lane request record (magic {magic:#010x}, expected {REQUEST_MAGIC:#010x})")
    if version != VERSION:
        raise RecordError(f"request record version {version}; this daemon speaks version {VERSION}")
    code = _OPCODES.get(opcode)  # a dict lookup: Opcode(opcode) costs ~1 us
    if code is None:
        raise RecordError(f"opcode {opcode} is not one of {[o.value for o in Opcode]}", "UNIMPLEMENTED")
    if flags & ~KNOWN_FLAGS:
        raise RecordError(f"unknown flag bits {flags & ~KNOWN_FLAGS:#x}")
    if flags & ~OPCODE_FLAGS.get(code, 0):
        raise RecordError(f"flag bits {flags & ~OPCODE_FLAGS.get(code, 0):#x} mean nothing for {code.name}")
    if count > MAX_TRANSFERS:
        raise RecordError(f"{count} transfers in one record (at most {MAX_TRANSFERS})")
    if count and code is Opcode.LOOKUP:
        raise RecordError(_LOOKUP_TRANSFERS)
    op_text = op_raw.rstrip(b"\0")
    if not PRINTABLE_OP_ID.fullmatch(op_text):
        raise RecordError(f"op_id must be printable ASCII (starts {op_text[:16]!r})")
    op_id = op_text.decode("ascii")
    if count == 0:
        keys = _read_keys(ring, offset + REQUEST.size, offset + AREA, max_keys) if code in KEYED else ()
        return Request(code, flags, seq, op_id, (), keys)
    descriptors = bytes(ring[offset + REQUEST.size : offset + REQUEST.size + count * TRANSFER.size])
    pages_needed = 0
    for i in range(count):
        _, ndev, nhost, _, _ = TRANSFER.unpack_from(descriptors, i * TRANSFER.size)
        pages_needed += ndev + nhost
    if pages_needed > MAX_PAGES:
        raise RecordError(
            f"record claims {pages_needed} page indices, more than fit in one lane record ({MAX_PAGES}); "
            "split the batch or use gRPC"
        )
    start = offset + REQUEST.size + count * TRANSFER.size
    body = descriptors + bytes(ring[start : start + 8 * pages_needed])
    transfers, _ = _read_transfers(body, 0, count, len(body))
    keys = _read_keys(ring, start + 8 * pages_needed, offset + AREA, max_keys) if code in KEYED else ()
    return Request(code, flags, seq, op_id, transfers, keys)


# ---------------------------------------------------------------- completions


def encode_completion(buf: memoryview, offset: int, c: Completion) -> None:
    """Write ``c`` at ``offset`` (the daemon's side); a result too large to fit becomes an error."""
    msg = c.message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
    COMPLETION.pack_into(
        buf, offset, COMPLETION_MAGIC, VERSION, c.opcode, c.seq, c.status, int(c.ok),
        -1 if c.retry_after_ms is None else c.retry_after_ms,
        len(c.transfers), len(c.acks), len(c.layers), c.value, len(msg), msg[:MESSAGE_BYTES],
    )  # fmt: skip
    pos = offset + COMPLETION.size
    if c.transfers:  # each section is skipped when empty: a ping or a Lookup has none
        pos = _write_transfers(buf, pos, c.transfers, offset + AREA)
    for a in c.acks:
        ACK.pack_into(buf, pos, _pack_name(a.pool, POOL_NAME_BYTES, "pool"), a.pages, a.tokens, a.bytes)
        pos += ACK.size
    if c.layers:
        layers = np.asarray(c.layers, dtype="<i4").tobytes()
        buf[pos : pos + len(layers)] = layers
        pos += len(layers)
    tail = msg[MESSAGE_BYTES:]
    if tail:
        if pos + len(tail) > offset + AREA:
            raise ValueError(f"a message of {len(msg)} bytes does not fit after the completion's sections")
        buf[pos : pos + len(tail)] = tail


def read_completion(ring: memoryview, offset: int) -> Completion:
    """Decode the completion at ``offset`` (the client's side; the daemon is trusted, checked anyway)."""
    fields = COMPLETION.unpack_from(ring, offset)
    magic, version, opcode, seq, status, ok, retry, ntr, nacks, nlayers, value, mlen, msg = fields
    if magic != COMPLETION_MAGIC or version != VERSION:
        raise RecordError(f"bad completion record (magic {magic:#x}, version {version})", "INTERNAL")
    transfers: tuple[WireTransfer, ...] = ()
    acks: list[WireAck] = []
    layers: tuple[int, ...] = ()
    if mlen > MAX_MESSAGE_BYTES:
        raise RecordError(
            f"completion claims a message of {mlen} bytes (at most {MAX_MESSAGE_BYTES})", "INTERNAL"
        )
    tail = max(0, mlen - MESSAGE_BYTES)
    if ntr or nacks or nlayers or tail:
        # A view, not a copy (the area is 1 MiB): the arrays decoded from it are copies,
        # and it is released on the way out (an error's frame must not keep the ring exported).
        with ring[offset + COMPLETION.size : offset + AREA] as body:
            transfers, pos = _read_transfers(body, 0, ntr, len(body))
            if pos + nacks * ACK.size + 4 * nlayers + tail > len(body):
                raise RecordError(
                    f"completion claims {nacks} acks, {nlayers} layers and {mlen} message bytes: "
                    "more than fit",
                    "INTERNAL",
                )
            for _ in range(nacks):
                raw, pages, tokens, nbytes = ACK.unpack_from(body, pos)
                acks.append(WireAck(_name(raw, "ack.pool"), pages, tokens, nbytes))
                pos += ACK.size
            layers = tuple(np.frombuffer(body, dtype="<i4", count=nlayers, offset=pos).tolist())
            pos += 4 * nlayers
            msg = msg[:MESSAGE_BYTES] + bytes(body[pos : pos + tail])
    return Completion(
        opcode=opcode,
        seq=seq,
        status=status,
        ok=bool(ok),
        retry_after_ms=None if retry < 0 else retry,
        message=msg[:mlen].decode("utf-8", "replace"),
        transfers=transfers,
        acks=tuple(acks),
        layers=layers,
        value=value,
    )


def init_ring(buf: memoryview) -> None:
    RING_HEADER.pack_into(buf, 0, RING_MAGIC, VERSION, 0, SLOTS, AREA, MAX_LAYERS)


def check_ring(buf: memoryview) -> None:
    magic, version, _, slots, area, layers = RING_HEADER.unpack_from(buf, 0)
    if (magic, version, slots, area, layers) != (RING_MAGIC, VERSION, SLOTS, AREA, MAX_LAYERS):
        raise RecordError(
            f"lane ring of another layout (magic {magic:#x}, version {version})", "FAILED_PRECONDITION"
        )
