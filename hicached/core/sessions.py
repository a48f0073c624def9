"""Worker sessions: identity, lease, owned host pages, idempotent operations.

Thread-safety: ``Session`` guards its mutable state with its own lock; the
``SessionTable`` guards the id -> session and slot -> session maps. Each session
holds its :class:`~hicached.core.ledger.PageLedger` (page ownership, recorded in its
group's owner table, not in the pools) so that a session that ends can give back
exactly what it held, once.

Idempotent operations (:meth:`Session.run`, the one way an operation runs)
remember their answers by ``(rpc, op_id)`` in the session's
:class:`hicached.core.opcache.OpCache` (see that module for what a retry gets).
"""

from __future__ import annotations

import collections
import hmac
import itertools
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from hicached.core.ledger import PageLedger
from hicached.core.opcache import OpCache
from hicached.core.stats import SessionPoolStats, SessionStats
from hicached.core.types import PeerCred, WorkerId
from hicached.errors import (
    Cancelled,
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    clip,
)
from hicached.l2.group import PoolTransfer
from hicached.transfer.mappings import DeviceMappings
from hicached.transfer.plan import DevicePoolView, LayerCache

T = TypeVar("T")


def now_ms() -> int:
    return int(time.time() * 1000)


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


# Session serials: from 1 up, never reused (``next`` on a count is atomic under the GIL).
_SERIALS = itertools.count(1)


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
    # Prefetch calls past the limit check whose task is not in ``prefetches`` yet.
    prefetches_starting: int = 0
    # Run by the last operation to finish (a teardown whose wait reached its deadline).
    on_idle: list[Callable[[], None]] = field(default_factory=list)
    # The capability a caller must present to act as this session (hex, 128 bits).
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    # Who attached it, from the kernel (fd handoff); None for TCP / no-handoff attaches.
    peer: PeerCred | None = None
    # Who attached it, as far as the daemon can tell (``uid:N``, ``tcp:<host>``, ``unix``, or
    # "" in process): only the same origin and tenant may replace it in its worker slot.
    origin: str = ""
    # build_plan's checked layers of this session's views (see hicached.transfer.plan).
    plan_layers: LayerCache = field(default_factory=dict)
    # Its pools as GetStats reports them (buffers, data path).
    pools: tuple[SessionPoolStats, ...] = ()
    # The tag of the bytes this session writes into its host pages, given to no other session
    # in the daemon's life: a page it frees comes back to it unzeroed, to anyone else zeroed
    # (hicached.l2.allocator.PageAllocator.take_dirty).
    serial: int = field(default_factory=lambda: next(_SERIALS))

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
    """id -> Session and worker slot -> live session. While a slot's session lives, only a higher
    generation from the same origin and tenant replaces it; nothing is kept of ended sessions
    (so no client can reserve a slot it does not hold, and the table is as large as the live
    sessions).

    It also counts who else still uses each pool group (:meth:`hold`): an attach between
    choosing its group and adding its session, and an ended session until its teardown has
    run (deferred while a call of it is in flight). A group is :meth:`unused` only without
    either, so it is never retired or recreated under them: before, an ended session's late
    teardown freed its page numbers into the group rebuilt under the same id, pages another
    session held (two owners of a page; one tenant read another's bytes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Session] = {}
        self._by_slot: dict[tuple[str, int, int], Session] = {}
        self._holds: collections.Counter[str] = collections.Counter()

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    def check_generation(self, worker: WorkerId, origin: str) -> Session | None:
        """The session this attach would replace; PermissionDenied when the slot's session was
        attached by another origin or tenant, FailedPrecondition if ``worker`` is stale."""
        with self._lock:
            current = self._by_slot.get(worker.slot)
            if current is None:
                return None
            name = f"worker {worker.instance_id[:64]!r} (tp_rank={worker.tp_rank}, pp_rank={worker.pp_rank})"
            if current.origin != origin:
                # Who holds the slot (a uid, a TCP host) is not this caller's to learn: the
                # refusal says only that it is another peer, and what to do about it.
                raise PermissionDenied(
                    f"{name} is attached by another peer; only the peer (uid or host) that attached "
                    "it may replace it: give each worker an instance_id unique in the deployment, "
                    "or wait for that session to end"
                )
            if current.worker.tenant != worker.tenant:
                raise PermissionDenied(
                    f"{name} is attached in another tenant; only that tenant may replace it"
                )
            seen = current.worker.generation
            if worker.generation < seen:
                raise FailedPrecondition(
                    f"stale generation {worker.generation} for {name}: generation {seen} is attached"
                )
            if current.worker.generation == worker.generation:
                raise FailedPrecondition(
                    f"worker {clip(worker.instance_id)} generation {worker.generation} is already attached "
                    f"as session {current.session_id}; attach with a higher generation to replace it"
                )
            return current

    def hold(self, group_id: str) -> None:
        """Count one more user of the group besides its live sessions (see the class)."""
        with self._lock:
            self._holds[group_id] += 1

    def unhold(self, group_id: str) -> None:
        """Drop a :meth:`hold` (exactly once per hold)."""
        with self._lock:
            self._unhold_locked(group_id)

    def _unhold_locked(self, group_id: str) -> None:
        self._holds[group_id] -= 1
        if self._holds[group_id] <= 0:
            del self._holds[group_id]

    def holds(self, group_id: str) -> int:
        r"""The group's :meth:`hold`\ s now: attaches in progress and ended sessions not yet torn down."""
        with self._lock:
            return self._holds[group_id]

    def unused(self, group_id: str) -> bool:
        """No live session of the group and no :meth:`hold` on it: it may be retired."""
        with self._lock:
            return not self._holds[group_id] and all(s.group_id != group_id for s in self._by_id.values())

    def add(self, session: Session) -> None:
        """Add the attached session, turning its attach's :meth:`hold` into the session.
        FailedPrecondition, nothing changed, if another attach of its worker slot was added
        since :meth:`check_generation` (both passed it; the slot holds one live session)."""
        with self._lock:
            if self._by_slot.get(session.worker.slot) is not None:
                raise FailedPrecondition(
                    f"worker {clip(session.worker.instance_id)} (generation {session.worker.generation}) "
                    "was attached by another call meanwhile; attach with a higher generation to replace it"
                )
            self._by_id[session.session_id] = session
            self._by_slot[session.worker.slot] = session
            self._unhold_locked(session.group_id)

    def remove(self, session_id: str) -> Session | None:
        r"""End the session: it leaves the table and :meth:`hold`\ s its group until its
        teardown calls :meth:`unhold`. None (and nothing held) if it had ended already."""
        with self._lock:
            session = self._by_id.pop(session_id, None)
            if session is not None:
                if self._by_slot.get(session.worker.slot) is session:
                    del self._by_slot[session.worker.slot]
                self._holds[session.group_id] += 1
            return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._by_id.get(session_id)
        if session is None:
            raise NotFound(f"unknown session {clip(session_id)} (expired, detached or never attached)")
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

    def in_group(self, group_id: str, tenant: str | None = None) -> int:
        """Live sessions of the group (of ``tenant`` only, when given)."""
        with self._lock:
            return sum(
                1
                for s in self._by_id.values()
                if s.group_id == group_id and (tenant is None or s.worker.tenant == tenant)
            )
