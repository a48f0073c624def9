"""The fast lane's listener: ``<grpc socket>.lane``, one thread per lane, bounded.

gRPC stays the contract and the fallback; a session may open a lane for its hot
operations (Write, Load, ResolveTransfers, ReleaseTransfers, and GetPages/PutPages/Lookup
with given keys) whose round trip is a shared-memory ring and two eventfd doorbells instead
of an HTTP/2 call. Protocol and per-lane behaviour: :mod:`hicached.server.lane`; record
layout: :mod:`hicached_client.lane_wire`; prose: docs/fastlane.md.

Bounds: at most ``max_lanes`` connections (negotiating or open) in total,
``max_per_session`` open lanes per session and ``max_per_uid`` per client uid; a connection beyond them is answered
``error RESOURCE_EXHAUSTED ...`` and closed, as is one whose thread cannot start (out of
threads: RLIMIT_NPROC, pids.max). All ``max_lanes`` taken, a newcomer of a uid holding fewer
displaces the oldest still-negotiating connection of the uid holding the most, if that uid
holds more than the newcomer's uid then will (the fd handoff's rule): uids filling every slot with
connections that never negotiate cannot keep another uid off the lane. An open lane is never
displaced (it is another thread's working lane); a newcomer that can displace none is refused
and uses gRPC. The acceptor never dies while the server is open: out of
descriptors it pauses (:mod:`hicached.accept`), any other failure is
logged, counted by ``on_failure("lane_accept")`` and accepting goes on.

Thread-safety: ``start``/``close`` from one thread; the acceptor and lane threads share only
the registry under ``_lock`` and the per-uid counts (:class:`hicached.accept.UidSlots`, its own
lock, taken inside ``_lock`` and never around it); ``on_failure`` is called on the acceptor
thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from hicached_client.lane_wire import SUFFIX

from hicached.accept import ACCEPT_PAUSE_S, AcceptPauses, UidSlots, refuse
from hicached.config import LimitsConfig
from hicached.core.keyed import KeyedCache
from hicached.core.service import HiCacheCore
from hicached.server.lane import Lane, Refused
from hicached.server.observer import NullRpcObserver, RpcObserver
from hicached.server.sockets import BoundSocket

logger = logging.getLogger(__name__)

__all__ = ["LaneServer", "lane_path"]


def _refuse(conn: socket.socket, reason: str) -> None:
    """The lane protocol's refusal line (docs/fastlane.md), then close."""
    refuse(conn, f"error RESOURCE_EXHAUSTED {reason}\n")


def lane_path(grpc_socket: str | Path) -> Path:
    """The lane socket of a daemon serving gRPC on ``grpc_socket``."""
    return Path(f"{grpc_socket}{SUFFIX}")


class LaneServer:
    """Accepts lane connections on its own thread; each lane runs on a thread of its own."""

    def __init__(
        self,
        core: HiCacheCore,
        keyed: KeyedCache,
        path: Path,
        *,
        mode: int,
        max_lanes: int,
        max_per_session: int,
        max_per_uid: int,
        limits: LimitsConfig,
        observe: RpcObserver | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self._core = core
        self._keyed = keyed
        self._limits = limits
        self._path = path
        self._mode = mode
        self._max_lanes = max_lanes
        self._max_per_session = max_per_session
        self._observe: RpcObserver = observe or NullRpcObserver()
        self._on_failure = on_failure
        self._pauses = AcceptPauses("fast lane", "lane")
        self._lock = threading.Lock()
        self._threads: dict[Lane, threading.Thread] = {}  # joined at close()
        self._open = 0  # lanes counted against max_lanes: started and not yet released
        self._per_session: Counter[str] = Counter()
        # Lanes open or negotiating, by SO_PEERCRED uid: taken by the acceptor, released by the
        # lane's thread (UidSlots has its own lock; taken inside _lock, never the other way).
        self._uids = UidSlots(
            max_per_uid, "fast lanes open or opening (server.fast_lane_max_per_uid)", "close one or use gRPC"
        )
        self._uid_of: dict[Lane, int] = {}
        # Lanes not yet admitted, oldest first (dicts keep insertion order): the only ones a
        # newcomer may displace. A displaced lane's slots are given back at once; its release()
        # then gives back nothing.
        self._negotiating: dict[Lane, None] = {}
        self._displaced: set[Lane] = set()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._bound: BoundSocket | None = None

    @property
    def path(self) -> Path:
        return self._path

    def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # Probed (a live daemon's refused, any other file kept) and bound privately, then
            # linked into place, bound with its mode: nothing is chmodded.
            self._bound = BoundSocket.bind(listener, self._path, self._mode, "l")
            listener.listen(64)
        except BaseException:
            listener.close()
            if self._bound is not None:
                self._bound.unlink()
                self._bound = None
            raise
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name="hicached-lane-accept", daemon=True)
        self._acceptor.start()
        logger.info("fast lane listening", extra={"event": "lane", "socket": str(self._path)})

    def _accept_loop(self) -> None:
        """The acceptor thread: never dies while the server is open. An accept out of
        descriptors pauses (:data:`ACCEPT_PAUSE_S`); any other failure of one connection's
        set-up is logged, counted (``on_failure("lane_accept")``) and the loop goes on."""
        listener = self._listener
        assert listener is not None
        poller = select.poll()
        poller.register(listener.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            try:
                self._accept_one(listener)
            except Exception:
                logger.exception("fast lane acceptor failed; accepting again", extra={"event": "task_failed"})
                if self._on_failure is not None:
                    self._on_failure("lane_accept")
                if self._stopped_within(ACCEPT_PAUSE_S):  # a persistent fault must not spin
                    return

    def _stopped_within(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for close(); True when it was called."""
        stop = select.poll()
        stop.register(self._stop_r, select.POLLIN)
        return bool(stop.poll(int(timeout_s * 1000)))

    def _accept_one(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            if self._pauses.failed(exc):
                self._stopped_within(ACCEPT_PAUSE_S)  # the loop's poll sees a close() at once
            return
        try:
            self._start_lane(conn)
        except BaseException:
            conn.close()
            raise

    def _start_lane(self, conn: socket.socket) -> None:
        # Counted per uid from accept on, not from admission: a uid holding idle connections
        # that never negotiate would otherwise hold every slot of max_lanes (and as many
        # threads) and lock every other user out.
        uid, refusal = self._uids.take(conn)
        if refusal is not None:
            refuse(conn, refusal)
            return
        victim: tuple[Lane, int] | None = None
        with self._lock:
            if self._open >= self._max_lanes:
                victim = self._make_room_locked(uid)
            if self._open >= self._max_lanes:
                lane = None
            else:
                lane = Lane(
                    self._core,
                    self._keyed,
                    conn,
                    stop_fd=self._stop_r,
                    admit=self._admit,
                    release=self._release,
                    observe=self._observe,
                    limits=self._limits,
                )
                thread = threading.Thread(target=self._run, args=(lane,), name="hicached-lane", daemon=True)
                self._threads[lane] = thread
                self._uid_of[lane] = uid
                self._negotiating[lane] = None
                self._open += 1
        if lane is None:
            self._uids.release(uid)
            _refuse(
                conn, f"{self._max_lanes} fast lanes are open (server.fast_lane_max); use gRPC or retry later"
            )
            return
        try:
            thread.start()
        except RuntimeError as exc:
            # Out of threads (RLIMIT_NPROC, a container's pids.max): this client is refused as
            # for any other limit; the acceptor stays (it died here, and SIGTERM then crashed
            # joining the never-started thread).
            with self._lock:
                self._threads.pop(lane, None)
                self._negotiating.pop(lane, None)
                self._open -= 1  # its run() never started, so never releases
                self._drop_uid(lane)
                if victim is not None:  # not told yet: it keeps its slot
                    self._restore_locked(*victim)
            logger.warning("fast lane refused: cannot start its thread: %s", exc, extra={"event": "lane"})
            _refuse(conn, f"the daemon cannot start a thread for this lane ({exc}); use gRPC or retry later")
            return
        # Told only once the newcomer runs: a newcomer refused for want of a thread (likeliest
        # when the slots are full) ends nobody's negotiation.
        if victim is not None:
            logger.info(
                "fast lane connection of uid %d dropped for uid %d (all %d taken)",
                victim[1],
                uid,
                self._max_lanes,
                extra={"event": "lane", "uid": victim[1]},
            )
            victim[0].displace(
                "error RESOURCE_EXHAUSTED all fast lane slots are taken and your uid holds the most; "
                "use gRPC or retry\n"
            )

    def _run(self, lane: Lane) -> None:
        try:
            lane.run()
        finally:
            with self._lock:
                self._threads.pop(lane, None)

    def _make_room_locked(self, uid: int) -> tuple[Lane, int] | None:
        """All ``max_lanes`` taken and a newcomer of ``uid`` (its uid slot taken, not yet counted
        here) wants one: the oldest negotiating lane of the uid holding the most, if that uid
        holds more than ``uid`` then will, gives its slots back now and is returned with its uid
        (the caller tells it, outside the lock, or restores it); else None. O(``max_lanes``),
        under the lock."""
        held = Counter(self._uid_of.values())
        mine = held[uid] + 1
        candidates = [lane for lane in self._negotiating if held[self._uid_of[lane]] > mine]
        if not candidates:
            return None
        most = max(held[self._uid_of[lane]] for lane in candidates)
        victim = next(lane for lane in candidates if held[self._uid_of[lane]] == most)
        victim_uid = self._uid_of[victim]
        del self._negotiating[victim]
        self._displaced.add(victim)
        self._open -= 1
        self._drop_uid(victim)
        return victim, victim_uid

    def _restore_locked(self, lane: Lane, uid: int) -> None:
        """Under the lock: ``lane``, displaced for a newcomer that could not start after all,
        holds its slots again, unless its thread has ended meanwhile (it released nothing)."""
        if lane not in self._displaced:
            return
        self._displaced.discard(lane)
        self._negotiating[lane] = None
        self._uid_of[lane] = uid
        self._open += 1
        self._uids.restore(uid)

    def _admit(self, lane: Lane, session_id: str) -> None:
        """Count ``lane`` against its session's limit (Refused when reached, or when a newcomer
        displaced it); its uid was counted at accept (the same ``SO_PEERCRED``)."""
        with self._lock:
            if lane in self._displaced:
                raise Refused(
                    "RESOURCE_EXHAUSTED",
                    "all fast lane slots are taken and your uid holds the most; use gRPC or retry",
                )
            del self._negotiating[lane]
            if self._per_session[session_id] >= self._max_per_session:
                raise Refused(
                    "RESOURCE_EXHAUSTED",
                    f"session {session_id[:16]!r} already has {self._max_per_session} fast lanes "
                    "(server.fast_lane_max_per_session); close one or use gRPC",
                )
            self._per_session[session_id] += 1

    def _release(self, lane: Lane, admitted: bool) -> None:
        """``lane`` is ending: its slot of ``max_lanes`` and its uid's, and its session's where
        ``admitted`` (called once per started lane, from its thread)."""
        with self._lock:
            if lane in self._displaced:  # its slots were given back when it was displaced
                self._displaced.discard(lane)
                return
            self._negotiating.pop(lane, None)
            self._open -= 1
            self._drop_uid(lane)
            if not admitted:
                return
            self._per_session[lane.session_id] -= 1
            self._per_session += Counter()  # drop zero counts: only live sessions are held

    def _drop_uid(self, lane: Lane) -> None:
        """Under the lock: ``lane``'s uid slot is free (once)."""
        uid = self._uid_of.pop(lane, None)
        if uid is not None:
            self._uids.release(uid)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every lane (each finishes its current op), unlink our socket. Idempotent."""
        if self._stop_w < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")  # level-triggered: every poller sees it until we close
        timeout_s = min(timeout_s, threading.TIMEOUT_MAX)
        acceptor = self._acceptor
        if acceptor is not None:
            acceptor.join(timeout_s)
        with self._lock:
            threads = list(self._threads.values())
        deadline = time.monotonic() + timeout_s  # one budget for all lanes, not one each
        for t in threads:
            if t.ident is not None:  # a thread that could not start is not joinable (RuntimeError)
                t.join(max(0.0, deadline - time.monotonic()))
        if acceptor is not None and acceptor.is_alive():
            threads.append(acceptor)
        # The pipe stays open while a thread still polls it (past a zero grace period, say): a
        # closed one is no stop signal, and the acceptor spun on its closed listener (EBADF).
        if not any(t.is_alive() for t in threads) and self._stop_r >= 0:
            os.close(self._stop_r)  # no lane polls it any more
            os.close(self._stop_w)
            self._stop_r = self._stop_w = -1
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self._bound is not None:
                self._bound.unlink()  # only if it is still ours; a failure is logged there
                self._bound = None
