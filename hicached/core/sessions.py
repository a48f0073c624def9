"""Worker sessions: identity, lease, owned host pages, idempotent operations.

Thread-safety: ``Session`` guards its mutable state with its own lock; the
``SessionTable`` guards the id -> session and slot -> session maps. Page
ownership lives here (not in the pools) so that a session that ends can give
back exactly what it held, once.

Idempotent operations (:meth:`Session.run`, the one way an operation runs):
an answer is remembered per session under ``(rpc, op_id)`` together with a
digest of the call's arguments (:func:`op_digest`, computed by the core from
the decoded call, so the servicer passes nothing extra and in-process callers
get the same contract). A retry with the same key and digest gets the stored
answer; the same key with another digest is INVALID_ARGUMENT. Only answers no
retry could change are remembered: successes, and errors that depend on the
request alone (:data:`PERMANENT_ERRORS`), stored as class and message, never
as the exception with its traceback. "No room" answers (``None`` or a result
whose ``ok`` is False) and every other error are forgotten, so a retry after
backpressure runs again. The store is an LRU bounded by entries and bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

import numpy as np

from hicached.core.stats import SessionPoolStats, SessionStats
from hicached.core.types import PeerCred, WorkerId
from hicached.errors import (
    Cancelled,
    FailedPrecondition,
    HiCacheError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
)
from hicached.l2.group import PoolTransfer
from hicached.transfer.handles import DeviceMappings
from hicached.transfer.plan import DevicePoolView

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
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"T" if value else b"F")
    elif isinstance(value, (int, np.integer)):
        h.update(b"i" + str(int(value)).encode() + b";")
    elif isinstance(value, float):
        h.update(b"f" + value.hex().encode() + b";")
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        h.update(b"s%d:" % len(raw) + raw)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        h.update(b"b%d:" % len(raw) + raw)
    elif isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value.astype(np.int64) if value.dtype.kind in "iub" else value)
        h.update(b"a%s%d:" % (arr.dtype.str.encode(), arr.size) + arr.tobytes())
    elif is_dataclass(value) and not isinstance(value, type):
        h.update(b"d" + type(value).__name__.encode() + b"{")
        for f in fields(value):
            _feed(h, f.name)
            _feed(h, getattr(value, f.name))
        h.update(b"}")
    elif isinstance(value, dict):
        h.update(b"m%d{" % len(value))
        for k in sorted(value, key=repr):
            _feed(h, k)
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"l%d[" % len(value))
        for item in value:
            _feed(h, item)
        h.update(b"]")
    else:
        raise TypeError(f"op_digest cannot encode {type(value).__name__}")


def answer_bytes(value: object) -> int:
    """Estimated memory a remembered answer holds (what the byte bound counts)."""
    if isinstance(value, np.ndarray):
        return 112 + int(value.nbytes)
    if isinstance(value, (str, bytes, bytearray)):
        return sys.getsizeof(value)
    if isinstance(value, (list, tuple)):
        return sys.getsizeof(value) + sum(answer_bytes(v) for v in value)
    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(answer_bytes(k) + answer_bytes(v) for k, v in value.items())
    if is_dataclass(value) and not isinstance(value, type):
        return 64 + sum(answer_bytes(getattr(value, f.name)) for f in fields(value))
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


class OpCache:
    """Answers of one session's operations by ``(rpc, op_id)``; LRU, bounded by entries and bytes.

    Thread-safety: one lock; a concurrent duplicate of an operation in flight
    waits for its outcome (result or error) instead of running it twice.
    """

    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple[str, str], _Remembered] = OrderedDict()
        self._running: dict[tuple[str, str], tuple[bytes, Future[Any]]] = {}
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
            running = self._running.get(key)
            if running is None:
                fut: Future[Any] = Future()
                self._running[key] = (digest, fut)
            else:
                self._check_digest(running[0], digest, rpc, op_id)
                fut = running[1]
        if running is not None:
            shared: T = fut.result()  # a concurrent duplicate shares the first one's outcome
            return shared
        try:
            value = fn()
        except BaseException as exc:
            remembered = None
            if isinstance(exc, PERMANENT_ERRORS):
                remembered = _Remembered(digest, 200 + len(str(exc)), error=(type(exc), str(exc)))
            self._finish(key, remembered)
            fut.set_exception(exc)
            del fut  # the traceback must not outlive this call
            raise
        transient = value is None or getattr(value, "ok", True) is False
        self._finish(key, None if transient else _Remembered(digest, 200 + answer_bytes(value), value=value))
        fut.set_result(value)
        return value

    @staticmethod
    def _check_digest(stored: bytes, digest: bytes, rpc: str, op_id: str) -> None:
        if stored != digest:
            raise InvalidArgument(
                f"op_id {quote_op_id(op_id)} was already used for a different {rpc} request in this "
                "session; a retry must resend the same request, a new operation needs a new op_id"
            )

    def _finish(self, key: tuple[str, str], answer: _Remembered | None) -> None:
        with self._lock:
            self._running.pop(key, None)
            if answer is None or answer.nbytes > self.max_bytes:
                return
            self._done[key] = answer
            self._bytes += answer.nbytes
            while self._done and (len(self._done) > self.max_entries or self._bytes > self.max_bytes):
                _, old = self._done.popitem(last=False)
                self._bytes -= old.nbytes


def now_ms() -> int:
    return int(time.time() * 1000)


class PageLedger:
    """Which host pages of each pool a holder owns (a bool mask per pool)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self._owned = {name: np.zeros(n, dtype=bool) for name, n in sizes.items()}

    def add(self, pool: str, pages: np.ndarray) -> None:
        self._owned[pool][pages] = True

    def remove(self, pool: str, pages: np.ndarray) -> None:
        self._owned[pool][pages] = False

    def owns(self, pool: str, pages: np.ndarray) -> np.ndarray:
        owned: np.ndarray = self._owned[pool][pages]
        return owned

    def take_all(self) -> dict[str, np.ndarray]:
        out = {}
        for name, mask in self._owned.items():
            out[name] = np.flatnonzero(mask).astype(np.int64)
            mask[:] = False
        return out

    def count(self) -> int:
        return int(sum(int(m.sum()) for m in self._owned.values()))


@dataclass
class Backup:
    """A retracted request's pages, resident until ``expires_ms`` (its lease)."""

    backup_id: str
    session_id: str
    group_id: str
    request_id: str
    transfers: tuple[PoolTransfer, ...]
    num_tokens: int
    expires_ms: int

    @property
    def pages(self) -> int:
        return sum(
            len(t.host_indices) for t in self.transfers if t.host_allocated and t.host_indices is not None
        )


@dataclass
class Session:
    session_id: str
    worker: WorkerId
    group_id: str
    lease_ms: int
    mappings: DeviceMappings
    views: dict[str, DevicePoolView]
    ledger: PageLedger
    expires_ms: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancel: threading.Event = field(default_factory=threading.Event)
    op_cache_size: int = 4096
    op_cache_bytes: int = 4 << 20
    ops: OpCache = field(init=False)
    in_flight: int = 0
    idle: threading.Condition = field(init=False)
    prefetches: set[str] = field(default_factory=set)
    # Run by the last operation to finish (a teardown whose wait reached its deadline).
    on_idle: list[Callable[[], None]] = field(default_factory=list)
    # The capability a caller must present to act as this session (hex, 128 bits).
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    # Who attached it, from the kernel (fd handoff); None for TCP / no-handoff attaches.
    peer: PeerCred | None = None
    # Its pools as GetStats reports them (buffers, data path).
    pools: tuple[SessionPoolStats, ...] = ()

    def __post_init__(self) -> None:
        self.idle = threading.Condition(self.lock)
        self.ops = OpCache(max_entries=self.op_cache_size, max_bytes=self.op_cache_bytes)
        self.touch()

    def touch(self) -> int:
        self.expires_ms = now_ms() + self.lease_ms
        return self.expires_ms

    def stats(self) -> SessionStats:
        """A snapshot for GetStats (pages owned now, lease end, pools as attached)."""
        return SessionStats(
            self.session_id, self.worker, self.group_id, self.ledger.count(), self.expires_ms, self.pools
        )

    def run(self, rpc: str, op_id: str, body: object, fn: Callable[[], T], *, in_flight: bool = True) -> T:
        """Run one operation of RPC ``rpc``: the one way a mutating call runs.

        ``body`` is the decoded call (digested only when ``op_id`` is set).
        With ``in_flight`` the operation counts as in flight, so the session's
        teardown waits for it and a cancelled session refuses it (Cancelled);
        detach itself runs with ``in_flight=False``. See the module docstring
        for what a repeated ``(rpc, op_id)`` gets.
        """
        if in_flight:
            with self.operation():
                return fn() if not op_id else self.ops.run(rpc, op_id, body, fn)
        return fn() if not op_id else self.ops.run(rpc, op_id, body, fn)

    @contextmanager
    def operation(self) -> Iterator[None]:
        """Mark an operation in flight so teardown waits for it before unmapping."""
        with self.lock:
            if self.cancel.is_set():
                raise Cancelled(f"session {self.session_id} has ended")
            self.in_flight += 1
        try:
            yield
        finally:
            callbacks: list[Callable[[], None]] = []
            with self.lock:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.idle.notify_all()
                    callbacks, self.on_idle = self.on_idle, []
            for callback in callbacks:
                callback()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        with self.lock:
            return self.idle.wait_for(lambda: self.in_flight == 0, timeout=timeout_s)

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once no operation is in flight: now (on this thread) or on the
        thread of the last operation to finish. For a teardown that may not wait longer."""
        with self.lock:
            if self.in_flight:
                self.on_idle.append(callback)
                return
        callback()


class SessionTable:
    """id -> Session and worker slot -> current session; generations only move forward."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Session] = {}
        self._by_slot: dict[tuple[str, int, int], Session] = {}
        self._generation: dict[tuple[str, int, int], int] = {}

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    def check_generation(self, worker: WorkerId) -> Session | None:
        """The session this attach would replace; FailedPrecondition if ``worker`` is stale."""
        with self._lock:
            seen = self._generation.get(worker.slot)
            if seen is not None and worker.generation < seen:
                raise FailedPrecondition(
                    f"stale generation {worker.generation} for worker {worker.instance_id!r} "
                    f"(tp_rank={worker.tp_rank}, pp_rank={worker.pp_rank}): generation {seen} already attached"
                )
            current = self._by_slot.get(worker.slot)
            if current is not None and current.worker.generation == worker.generation:
                raise FailedPrecondition(
                    f"worker {worker.instance_id!r} generation {worker.generation} is already attached "
                    f"as session {current.session_id}; attach with a higher generation to replace it"
                )
            return current

    def add(self, session: Session) -> None:
        with self._lock:
            self._by_id[session.session_id] = session
            self._by_slot[session.worker.slot] = session
            self._generation[session.worker.slot] = session.worker.generation

    def remove(self, session_id: str) -> Session | None:
        with self._lock:
            session = self._by_id.pop(session_id, None)
            if session is not None and self._by_slot.get(session.worker.slot) is session:
                del self._by_slot[session.worker.slot]
            return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._by_id.get(session_id)
        if session is None:
            raise NotFound(f"unknown session {session_id!r} (expired, detached or never attached)")
        return session

    def check_secret(self, session_id: str, secret: str) -> None:
        """PermissionDenied unless ``secret`` is the secret of session ``session_id``.

        An unknown id passes: the handler then answers NOT_FOUND (or a retried
        detach's first answer), which reveals nothing a secret would protect.
        Constant-time compare, so timing does not leak the secret.
        """
        with self._lock:
            session = self._by_id.get(session_id)
        if session is None:
            return
        if not isinstance(secret, str) or not hmac.compare_digest(
            secret.encode("utf-8", "surrogateescape"), session.secret.encode()
        ):
            what = "no session secret" if not secret else "a wrong session secret"
            raise PermissionDenied(
                f"{what} for session {session_id[:16]!r}: send the session_secret Attach returned "
                "as metadata 'x-hicached-session-secret'"
            )

    def expired(self, now: int) -> list[Session]:
        with self._lock:
            return [s for s in self._by_id.values() if s.expires_ms <= now]

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._by_id.values())

    def in_group(self, group_id: str) -> int:
        with self._lock:
            return sum(1 for s in self._by_id.values() if s.group_id == group_id)
