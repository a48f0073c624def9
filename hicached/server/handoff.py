"""The fd handoff: how a worker gives the daemon its buffers without naming them.

A worker connects to ``<grpc socket>.fds`` (a Unix stream socket next to the gRPC
socket, same mode), sends ONE message whose payload is :data:`MAGIC` and whose
ancillary data carries 0..``max_fds`` file descriptors (``SCM_RIGHTS``). The
daemon reads the peer's credentials from the kernel (``SO_PEERCRED``: pid, uid,
gid -- they cannot be forged by the client), stores the fds and the credentials
under a fresh random ticket, replies ``ok <ticket>\\n`` (or ``error <STATUS_CODE> <reason>\\n``, a gRPC status name)
and closes the connection. The worker then calls Attach with the ticket; the
servicer :meth:`HandoffRegistry.take` s it exactly once.

Why a second socket: gRPC cannot carry file descriptors, and its Unix-socket
peer string carries no credentials. Why tickets: they bind the fds and the
kernel-verified identity to the one Attach that presents them.

Fd ownership: every fd received here is owned by the registry until
:meth:`HandoffRegistry.take` hands it to the caller (who must close it), and is
otherwise closed exactly once by the registry (ticket expiry, refusal, close).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hicached.accept import ACCEPT_PAUSE_S, AcceptPauses, UidSlots, peer_ids, refuse
from hicached.core.types import PeerCred
from hicached.server.sockets import BoundSocket

logger = logging.getLogger(__name__)

__all__ = ["HandoffRegistry", "HandoffServer", "PeerCred", "TicketRefused", "handoff_path", "peer_cred"]

MAGIC = b"hicached-fds-v1"
SUFFIX = ".fds"
# A handoff connection that has not sent its message within this time is dropped,
# so idle connections cannot pin daemon resources (a worker sends it right after connecting).
CONNECTION_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 64
# Connections of one uid under way at once; one more is refused at accept, so one local user
# cannot hold every slot (and the kernel's backlog behind them) and lock the others out.
MAX_CONNECTIONS_PER_UID = 32  # half of all: a node's workers may all start at once
_INT = array.array("i").itemsize


def handoff_path(grpc_socket: str | Path) -> Path:
    """The handoff socket of a daemon serving gRPC on ``grpc_socket``."""
    return Path(f"{grpc_socket}{SUFFIX}")


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass
class _Pending:
    cred: PeerCred
    fds: list[int]
    expires: float


class TicketRefused(Exception):
    """A handoff the registry does not accept; ``code`` is the gRPC status name the client reports."""

    def __init__(self, message: str, code: str = "RESOURCE_EXHAUSTED") -> None:
        super().__init__(message)
        self.code = code


class HandoffRegistry:
    """Pending handoffs by ticket. Thread-safe (one lock; every method is O(1) amortised).

    Bounds: at most ``max_pending`` tickets in total (when all are taken, a new one displaces
    the oldest ticket of the uid holding the most, if it holds more), ``max_per_uid`` per uid, and
    ``max_fds_per_uid`` descriptors held in one uid's tickets (a uid's full tickets would
    otherwise hold ``max_per_uid`` x ``server.handoff_max_fds`` of the daemon's descriptors,
    enough to run it out of them for every other client); a ticket lives ``ttl_s`` seconds.
    Expired tickets are swept on every put/take and
    by :meth:`expire`; their fds are closed.
    """

    def __init__(
        self,
        *,
        ttl_s: float = 30.0,
        max_pending: int = 256,
        max_per_uid: int = 32,
        max_fds_per_uid: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_pending = max_pending
        self._max_per_uid = max_per_uid
        self._max_fds_per_uid = max_fds_per_uid
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._closed = False

    def put(self, cred: PeerCred, fds: list[int]) -> str:
        """Store ``fds`` (ownership moves here) under a fresh ticket; returns the ticket.

        TicketRefused (and the fds are closed) when a bound is reached or the registry is closed.
        """
        stale: list[int] = []
        try:
            with self._lock:
                stale = self._sweep_locked()
                if self._closed:
                    raise TicketRefused("the daemon is shutting down", "UNAVAILABLE")
                mine = [p for p in self._pending.values() if p.cred.uid == cred.uid]
                if len(mine) >= self._max_per_uid:
                    raise TicketRefused(
                        f"uid {cred.uid} has {len(mine)} unused handoff tickets (limit {self._max_per_uid}); "
                        "attach with them or let them expire"
                    )
                held = sum(len(p.fds) for p in mine)
                if held + len(fds) > self._max_fds_per_uid:
                    raise TicketRefused(
                        f"uid {cred.uid} holds {held} fds in unused handoff tickets; {len(fds)} more would "
                        f"pass server.handoff_max_pending_fds_per_uid={self._max_fds_per_uid}: attach with "
                        "them or let them expire"
                    )
                if len(self._pending) >= self._max_pending:
                    # Last: a handoff refused by its own uid's bounds displaces nobody's ticket.
                    stale.extend(self._evict_for_locked(cred.uid))
                ticket = secrets.token_hex(16)
                self._pending[ticket] = _Pending(cred, list(fds), self._clock() + self._ttl_s)
                return ticket
        except TicketRefused:
            _close_all(fds)
            raise
        finally:
            _close_all(stale)

    def _evict_for_locked(self, uid: int) -> list[int]:
        """Room for one more of ``uid``'s tickets when all are taken: the oldest ticket of the
        uid holding the most goes (its fds returned, to close), if that uid holds more than
        ``uid`` will; else TicketRefused. So a few uids filling every ticket (8 at the
        defaults) cannot lock the others out: only the largest holders lose tickets."""
        held = Counter(p.cred.uid for p in self._pending.values())
        top, most = held.most_common(1)[0]
        if most <= held[uid] + 1:
            raise TicketRefused(f"too many pending handoffs ({self._max_pending}); retry shortly")
        ticket = next(t for t, p in self._pending.items() if p.cred.uid == top)
        logger.info(
            "fd handoff ticket of uid %d dropped for uid %d (all %d taken)",
            top,
            uid,
            self._max_pending,
            extra={"event": "handoff", "uid": top},
        )
        return self._pending.pop(ticket).fds

    def take(self, ticket: str) -> tuple[PeerCred, list[int]] | None:
        """Consume a ticket: its credentials and fds (the caller now owns and must close them).

        None when the ticket is unknown, already used or expired.
        """
        with self._lock:
            stale = self._sweep_locked()
            got = self._pending.pop(ticket, None) if isinstance(ticket, str) else None
        _close_all(stale)
        return None if got is None else (got.cred, got.fds)

    def expire(self) -> int:
        """Drop expired tickets (closing their fds); returns how many."""
        with self._lock:
            before = len(self._pending)
            stale = self._sweep_locked()
            dropped = before - len(self._pending)
        _close_all(stale)
        return dropped

    def _sweep_locked(self) -> list[int]:
        now = self._clock()
        fds: list[int] = []
        # Tickets are inserted in expiry order (constant ttl), so the oldest come first.
        while self._pending:
            ticket, pending = next(iter(self._pending.items()))
            if pending.expires > now:
                break
            del self._pending[ticket]
            fds.extend(pending.fds)
        return fds

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Refuse new handoffs and close the fds of every pending ticket. Idempotent."""
        with self._lock:
            self._closed = True
            fds = [fd for p in self._pending.values() for fd in p.fds]
            self._pending.clear()
        _close_all(fds)


def peer_cred(sock: socket.socket) -> PeerCred:
    """SO_PEERCRED of a connected Unix socket (:func:`hicached.accept.peer_ids`)."""
    pid, uid, gid = peer_ids(sock)
    return PeerCred(uid=uid, gid=gid, pid=pid)


def _received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - (len(data) % _INT)])
            fds.extend(arr)
    return fds


class HandoffServer:
    """Accepts handoff connections on the event loop without ever blocking it.

    Every socket is non-blocking and driven by ``add_reader``; a connection sends one
    message, gets one line back and is closed (or is dropped after
    :data:`CONNECTION_TIMEOUT_S`). At most :data:`MAX_CONNECTIONS` are open at once, at most
    :data:`MAX_CONNECTIONS_PER_UID` of one uid (``SO_PEERCRED`` at accept: :class:`UidSlots`,
    taken and released on the loop).

    All taken, the listener still accepts one connection more to learn its uid: if the uid
    holding the most would then still hold more than the newcomer's, the oldest of its
    connections is answered ``error RESOURCE_EXHAUSTED`` and closed, and the newcomer is
    admitted at once (:meth:`_make_room`: the registry's rule for tickets), so uids filling
    every slot with idle connections cannot keep another uid's handoff waiting out their
    timers. Else the newcomer waits, accepted but not read, for the next slot to free; one
    waits at most, a further one that cannot displace anyone is refused (``error
    RESOURCE_EXHAUSTED``), and the listener goes on accepting (a listener that stopped while
    one waited let uids that got themselves parked hold every other uid in the kernel's backlog).

    Thread-safety: none needed; ``start``/``close`` and every callback run on the loop's
    thread (the connections, the parked newcomer and the listener's reader are loop-only).
    """

    def __init__(self, registry: HandoffRegistry, path: Path, *, mode: int, max_fds: int) -> None:
        self._registry = registry
        self._path = path
        self._mode = mode
        self._max_fds = max_fds
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[socket.socket, asyncio.TimerHandle] = {}
        self._uid_of: dict[socket.socket, int] = {}
        # All taken and its uid could displace none: admitted when a slot frees (its uid slot held).
        self._parked: tuple[socket.socket, int] | None = None
        self._uids = UidSlots(MAX_CONNECTIONS_PER_UID, "fd handoffs under way", "finish one and retry")
        self._bound: BoundSocket | None = None
        self._pauses = AcceptPauses("fd handoff", "handoff")

    @property
    def path(self) -> Path:
        return self._path

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Probed (a live daemon's refused, any other file kept) and bound privately, then
            # linked into place, bound with its mode: nothing is chmodded.
            self._bound = BoundSocket.bind(listener, self._path, self._mode, "f")
            listener.listen(MAX_CONNECTIONS)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            if self._bound is not None:
                self._bound.unlink()
                self._bound = None
            raise
        self._listener = listener
        self._loop = loop
        loop.add_reader(listener.fileno(), self._accept)
        logger.info("fd handoff listening", extra={"event": "handoff", "socket": str(self._path)})

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        # At most a backlog's worth per wake-up: the reader stays registered, so a connect flood
        # (each one refused or displacing) takes turns with the rest of the event loop.
        for _ in range(MAX_CONNECTIONS):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._accept_failed(exc)
                return
            uid, refusal = self._uids.take(conn)
            if refusal is not None:
                refuse(conn, refusal)
                continue
            if len(self._conns) >= MAX_CONNECTIONS and not self._room_for(uid):
                if self._parked is None:
                    self._parked = (conn, uid)  # admitted when the next slot frees
                else:
                    # One waits at most: the listener goes on accepting, so uids that fill
                    # every slot and get themselves parked cannot hold a newcomer of a uid
                    # holding fewer in the kernel's backlog until a timer frees a slot.
                    self._uids.release(uid)
                    refuse(conn, "error RESOURCE_EXHAUSTED all fd handoff slots are taken; retry\n")
                continue
            self._admit(conn, uid)

    def _admit(self, conn: socket.socket, uid: int) -> None:
        """``conn`` (its uid slot taken) gets a slot: read when it sends, dropped on its timer."""
        assert self._loop is not None
        conn.setblocking(False)
        self._conns[conn] = self._loop.call_later(CONNECTION_TIMEOUT_S, self._drop, conn)
        self._uid_of[conn] = uid
        self._loop.add_reader(conn.fileno(), self._serve, conn)

    def _room_for(self, uid: int) -> bool:
        """:meth:`_make_room` for a newcomer of ``uid``: the slot it frees is the newcomer's, not
        the waiting one's (``_drop`` admits that one into a slot freed any other way)."""
        waiting, self._parked = self._parked, None
        try:
            return self._make_room(uid)
        finally:
            self._parked = waiting

    def _make_room(self, uid: int) -> bool:
        """All slots taken and ``uid`` wants one: free the slot of the oldest connection of the
        uid holding the most if that uid would still hold more than ``uid`` then will (True),
        else False. That connection is served if it has sent its message (its answer is ready
        at once), else answered ``error RESOURCE_EXHAUSTED`` and closed.
        O(:data:`MAX_CONNECTIONS`), on the loop."""
        held = Counter(self._uid_of.values())
        top, most = held.most_common(1)[0]
        if most <= held[uid] + 1:
            return False
        oldest = next(c for c, u in self._uid_of.items() if u == top)  # dicts keep admission order
        self._serve(oldest)  # dropped once answered; still here when it has sent nothing
        if oldest not in self._conns:
            return True
        logger.info(
            "fd handoff connection of uid %d dropped for uid %d (all %d taken)",
            top,
            uid,
            MAX_CONNECTIONS,
            extra={"event": "handoff", "uid": top},
        )
        with contextlib.suppress(OSError):
            oldest.send(
                b"error RESOURCE_EXHAUSTED all fd handoff slots are taken and your uid holds the most; retry\n"
            )
        self._drop(oldest)
        return True

    def _accept_failed(self, exc: OSError) -> None:
        """Out of descriptors the listener pauses (:mod:`hicached.accept`)."""
        if not self._pauses.failed(exc):
            return
        assert self._listener is not None and self._loop is not None
        listener = self._listener
        self._loop.remove_reader(listener.fileno())

        def resume() -> None:
            if self._listener is listener:
                self._loop.add_reader(listener.fileno(), self._accept)  # type: ignore[union-attr]

        self._loop.call_later(ACCEPT_PAUSE_S, resume)

    def _drop(self, conn: socket.socket) -> None:
        timer = self._conns.pop(conn, None)
        if timer is None:
            return
        timer.cancel()
        self._uids.release(self._uid_of.pop(conn))
        assert self._loop is not None
        self._loop.remove_reader(conn.fileno())
        conn.close()
        if self._parked is not None:
            parked, self._parked = self._parked, None
            self._admit(*parked)

    def _serve(self, conn: socket.socket) -> None:
        try:
            data, ancdata, flags, _ = conn.recvmsg(
                len(MAGIC) + 1, socket.CMSG_SPACE(self._max_fds * _INT), socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            logger.debug("fd handoff read failed: %s", exc)
            self._drop(conn)
            return
        fds = _received_fds(ancdata)
        reply = self._handle(conn, data, fds, flags)
        with contextlib.suppress(OSError):
            conn.send(reply)  # a few bytes on a fresh socket: never blocks
        self._drop(conn)

    def _handle(self, conn: socket.socket, data: bytes, fds: list[int], flags: int) -> bytes:
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            if len(fds) < self._max_fds:
                # The kernel installs fds until one fails: fewer than the buffer holds means the
                # daemon ran out of descriptors (EMFILE), not that the caller sent too many.
                return (
                    b"error RESOURCE_EXHAUSTED the daemon is out of file descriptors (EMFILE); retry later\n"
                )
            return f"error INVALID_ARGUMENT more than {self._max_fds} fds in one handoff (server.handoff_max_fds)\n".encode()
        if data != MAGIC:
            _close_all(fds)
            return b"error INVALID_ARGUMENT expected one message with payload " + MAGIC + b"\n"
        try:
            cred = peer_cred(conn)
        except OSError as exc:
            _close_all(fds)
            return f"error INTERNAL cannot read peer credentials: {exc.strerror}\n".encode()
        try:
            ticket = self._registry.put(cred, fds)
        except TicketRefused as exc:
            return f"error {exc.code} {exc}\n".encode()
        logger.debug(
            "fd handoff", extra={"event": "handoff", "uid": cred.uid, "pid": cred.pid, "fds": len(fds)}
        )
        return f"ok {ticket}\n".encode()

    def close(self) -> None:
        """Stop accepting, drop open connections, unlink our socket (only if it is still ours)."""
        if self._parked is not None:
            parked, uid = self._parked
            self._parked = None
            self._uids.release(uid)
            parked.close()
        if self._loop is not None:
            for conn in list(self._conns):
                self._drop(conn)
            if self._listener is not None:
                self._loop.remove_reader(self._listener.fileno())
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self._bound is not None:
                self._bound.unlink()  # only if it is still ours; a failure is logged there
                self._bound = None
