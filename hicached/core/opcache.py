"""Idempotent operations: the answers of one session's calls by ``(rpc, op_id)``.

An answer is remembered per session under ``(rpc, op_id)`` together with a
digest of the call's arguments (:func:`op_digest`, computed by the core from
the decoded call, so the servicer passes nothing extra and in-process callers
get the same contract). A retry with the same key and digest gets the stored
answer; the same key with another digest is INVALID_ARGUMENT. Only answers no
retry could change are remembered: successes, and errors that depend on the
request alone (:data:`PERMANENT_ERRORS`), stored as class and message, never
as the exception with its traceback. "No room" answers (``None`` or a result
whose ``ok`` is False) and every other error are forgotten, so a retry after
backpressure runs again. The store is an LRU bounded by entries and bytes.
Used through :meth:`hicached.core.sessions.Session.run`.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

import numpy as np

from hicached.errors import HiCacheError, InvalidArgument, OutOfRange

T = TypeVar("T")

PERMANENT_ERRORS: tuple[type[HiCacheError], ...] = (InvalidArgument, OutOfRange)
"""Errors that depend only on the request (and the group's fixed shape): remembered."""

_OP_ID_QUOTE = 32  # characters of a client's op_id quoted in an error


def op_digest(body: object) -> bytes:
    """A 16-byte digest of a decoded call (strings, numbers, bytes, arrays, dataclasses, containers).

    Canonical: equal calls (e.g. the same page list as a list or an int64
    array) digest equally; each value is tagged with its kind and length so
    that no two different bodies share an encoding.
    """
    h = hashlib.blake2b(digest_size=16)
    _feed(h, body)
    return h.digest()


def _feed(h: Any, value: object) -> None:
    # Exact types first, through one dict lookup (an isinstance chain per value was a third
    # of a small call's digest); subclasses, numpy scalars and new dataclasses take the chain.
    feeder = _FEEDERS.get(type(value))
    if feeder is not None:
        feeder(h, value)
    else:
        _feed_any(h, value)


def _feed_none(h: Any, value: None) -> None:
    h.update(b"N")


def _feed_bool(h: Any, value: bool) -> None:
    h.update(b"T" if value else b"F")


def _feed_int(h: Any, value: int) -> None:
    h.update(b"i%d;" % int(value))


def _feed_float(h: Any, value: float) -> None:
    h.update(b"f" + value.hex().encode() + b";")


def _feed_str(h: Any, value: str) -> None:
    raw = value.encode("utf-8", "surrogatepass")
    h.update(b"s%d:" % len(raw) + raw)


def _feed_bytes(h: Any, value: bytes | bytearray | memoryview) -> None:
    raw = bytes(value)
    h.update(b"b%d:" % len(raw) + raw)


def _feed_array(h: Any, value: np.ndarray) -> None:
    # int64 pages (the common case) are hashed in place: no conversion, no copy.
    arr = np.ascontiguousarray(value, dtype=np.int64) if value.dtype.kind in "iub" else value
    h.update(b"a%s%d:" % (arr.dtype.str.encode(), arr.size))
    h.update(arr.data if arr.flags.c_contiguous else arr.tobytes())


def _feed_dict(h: Any, value: dict[Any, Any]) -> None:
    h.update(b"m%d{" % len(value))
    for k in sorted(value, key=repr):
        _feed(h, k)
        _feed(h, value[k])
    h.update(b"}")


def _feed_seq(h: Any, value: list[Any] | tuple[Any, ...]) -> None:
    if value and isinstance(value[0], str):
        try:
            text = "".join(value)
        except TypeError:  # not all strings: each item by its kind, below
            pass
        else:
            _feed_strs(h, value, text)
            return
    h.update(b"l%d[" % len(value))
    for item in value:
        _feed(h, item)
    h.update(b"]")


def _feed_strs(h: Any, value: list[str] | tuple[str, ...], text: str) -> None:
    # A request's keys, all at once: one item at a time was three quarters of the digest of
    # a 128-key GetPages. The lengths in characters say where ``text`` splits.
    raw = text.encode("utf-8", "surrogatepass")
    h.update(b"S%d:%d:" % (len(value), len(raw)))
    h.update(array("q", map(len, value)))
    h.update(raw)


def _feed_dataclass(h: Any, value: Any) -> None:
    head, names = _dataclass_layout(type(value))
    h.update(head)
    for tag, name in names:
        h.update(tag)
        _feed(h, getattr(value, name))
    h.update(b"}")


_FEEDERS: dict[type, Callable[[Any, Any], None]] = {
    type(None): _feed_none,
    bool: _feed_bool,
    int: _feed_int,
    float: _feed_float,
    str: _feed_str,
    bytes: _feed_bytes,
    np.ndarray: _feed_array,
    dict: _feed_dict,
    list: _feed_seq,
    tuple: _feed_seq,
}


def _feed_any(h: Any, value: object) -> None:
    """The same encoding for subclasses and other kinds (checked in the order of a bool
    before an int); a dataclass is registered for the fast path on first sight."""
    if isinstance(value, bool):
        _feed_bool(h, value)
    elif isinstance(value, (int, np.integer)):
        _feed_int(h, int(value))
    elif isinstance(value, float):
        _feed_float(h, value)
    elif isinstance(value, str):
        _feed_str(h, value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _feed_bytes(h, value)
    elif isinstance(value, np.ndarray):
        _feed_array(h, value)
    elif is_dataclass(value) and not isinstance(value, type):
        _FEEDERS[type(value)] = _feed_dataclass
        _feed_dataclass(h, value)
    elif isinstance(value, dict):
        _feed_dict(h, value)
    elif isinstance(value, (list, tuple)):
        _feed_seq(h, value)
    else:
        raise TypeError(f"op_digest cannot encode {type(value).__name__}")


_LAYOUTS: dict[type, tuple[bytes, tuple[tuple[bytes, str], ...]]] = {}


def _dataclass_layout(cls: type) -> tuple[bytes, tuple[tuple[bytes, str], ...]]:
    """A dataclass's digest header and its fields' (encoded name, name): ``fields()`` once per
    class, not once per value (it dominated the digest of a page batch)."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        names = []
        for f in fields(cls):
            raw = f.name.encode("utf-8", "surrogatepass")
            names.append((b"s%d:" % len(raw) + raw, f.name))
        layout = _LAYOUTS[cls] = (b"d" + cls.__name__.encode() + b"{", tuple(names))
    return layout


def answer_bytes(value: object) -> int:
    """Estimated memory a remembered answer holds (what the byte bound counts)."""
    sizer = _SIZERS.get(type(value))
    return sizer(value) if sizer is not None else _size_any(value)


# Exact types through one dict lookup, as the digest's feeders (an isinstance chain per value
# cost as much as the digest of a small call); anything else takes the chain.
def _size_array(value: np.ndarray) -> int:
    return 112 + int(value.nbytes)


def _size_seq(value: list[Any] | tuple[Any, ...]) -> int:
    return sys.getsizeof(value) + sum(answer_bytes(v) for v in value)


def _size_dict(value: dict[Any, Any]) -> int:
    return sys.getsizeof(value) + sum(answer_bytes(k) + answer_bytes(v) for k, v in value.items())


def _size_dataclass(value: Any) -> int:
    return 64 + sum(answer_bytes(getattr(value, name)) for _, name in _dataclass_layout(type(value))[1])


_SIZERS: dict[type, Callable[[Any], int]] = {
    type(None): sys.getsizeof,
    bool: sys.getsizeof,
    int: sys.getsizeof,
    float: sys.getsizeof,
    str: sys.getsizeof,
    bytes: sys.getsizeof,
    np.ndarray: _size_array,
    list: _size_seq,
    tuple: _size_seq,
    dict: _size_dict,
}


def _size_any(value: object) -> int:
    if isinstance(value, np.ndarray):
        return _size_array(value)
    if isinstance(value, (str, bytes, bytearray)):
        return sys.getsizeof(value)
    if isinstance(value, (list, tuple)):
        return _size_seq(value)
    if isinstance(value, dict):
        return _size_dict(value)
    if is_dataclass(value) and not isinstance(value, type):
        _SIZERS[type(value)] = _size_dataclass
        return _size_dataclass(value)
    return sys.getsizeof(value)


def quote_op_id(op_id: str) -> str:
    """A client's op_id as quoted in messages: at most a short prefix."""
    clipped = op_id[:_OP_ID_QUOTE]
    return repr(clipped) + ("..." if len(op_id) > _OP_ID_QUOTE else "")


@dataclass(frozen=True)
class _Remembered:
    """A stored answer: a value, or a permanent error's class and message (no traceback)."""

    digest: bytes
    nbytes: int
    value: object = None
    error: tuple[type[HiCacheError], str] | None = None

    def replay(self) -> Any:
        if self.error is not None:
            cls, message = self.error
            raise cls(message)
        return self.value


class _InFlight:
    """A call that is running: its digest and, once it ended, its outcome. The event that
    duplicates wait on is made only when a duplicate arrives (a ``Future`` per call cost
    more than the digest of a small one)."""

    __slots__ = ("digest", "ended", "error", "value")

    def __init__(self, digest: bytes) -> None:
        self.digest = digest
        self.ended: threading.Event | None = None  # set under OpCache._lock, by the first duplicate
        self.value: Any = None
        self.error: BaseException | None = None


class OpCache:
    """Answers of one session's operations by ``(rpc, op_id)``; LRU, bounded by entries and bytes.

    Thread-safety: one lock; a concurrent duplicate of an operation in flight
    waits for its outcome (result or error) instead of running it twice.
    """

    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple[str, str], _Remembered] = OrderedDict()
        self._running: dict[tuple[str, str], _InFlight] = {}
        self._bytes = 0
        self.max_entries = max_entries
        self.max_bytes = max_bytes

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)

    def run(self, rpc: str, op_id: str, body: object, fn: Callable[[], T]) -> T:
        key = (rpc, op_id)
        digest = op_digest(body)
        with self._lock:
            done = self._done.get(key)
            if done is not None:
                self._done.move_to_end(key)
                self._check_digest(done.digest, digest, rpc, op_id)
                replay: T = done.replay()
                return replay
            flight = self._running.get(key)
            if flight is None:
                mine = self._running[key] = _InFlight(digest)
            else:
                self._check_digest(flight.digest, digest, rpc, op_id)
                if flight.ended is None:
                    flight.ended = threading.Event()
                ended = flight.ended
        if flight is not None:
            ended.wait()  # a concurrent duplicate shares the first one's outcome
            if flight.error is not None:
                raise flight.error
            shared: T = flight.value
            return shared
        try:
            value = fn()
        except BaseException as exc:
            remembered = None
            if isinstance(exc, PERMANENT_ERRORS):
                remembered = _Remembered(digest, 200 + len(str(exc)), error=(type(exc), str(exc)))
            mine.error = exc
            self._finish(key, mine, remembered)
            del mine  # the traceback must not outlive this call (a waiter holds its own reference)
            raise
        transient = value is None or getattr(value, "ok", True) is False
        mine.value = value
        self._finish(
            key, mine, None if transient else _Remembered(digest, 200 + answer_bytes(value), value=value)
        )
        return value

    @staticmethod
    def _check_digest(stored: bytes, digest: bytes, rpc: str, op_id: str) -> None:
        if stored != digest:
            raise InvalidArgument(
                f"op_id {quote_op_id(op_id)} was already used for a different {rpc} request in this "
                "session; a retry must resend the same request, a new operation needs a new op_id"
            )

    def _finish(self, key: tuple[str, str], flight: _InFlight, answer: _Remembered | None) -> None:
        """Forget the running call (its outcome is on ``flight``), remember ``answer``, then wake
        the duplicates that wait for it."""
        with self._lock:
            self._running.pop(key, None)
            ended = flight.ended
            if answer is not None and answer.nbytes <= self.max_bytes:
                self._done[key] = answer
                self._bytes += answer.nbytes
                while self._done and (len(self._done) > self.max_entries or self._bytes > self.max_bytes):
                    _, old = self._done.popitem(last=False)
                    self._bytes -= old.nbytes
        if ended is not None:  # read under the lock: a duplicate made it before the pop, or never
            ended.set()
