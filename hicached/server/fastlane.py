"""The fast lane's listener: ``<grpc socket>.lane``, one thread per lane, bounded.

gRPC stays the contract and the fallback; a session may open a lane for its hot
operations (Write, Load, ResolveTransfers, ReleaseTransfers, and GetPages/PutPages/Lookup
with given keys) whose round trip is a shared-memory ring and two eventfd doorbells instead
of an HTTP/2 call. Protocol and per-lane behaviour: :mod:`hicached.server.lane`; record
layout: :mod:`hicached_client.lane_wire`; prose: docs/fastlane.md.

Bounds: at most ``max_lanes`` connections (negotiating or open) in total,
``max_per_session`` open lanes per session and ``max_per_uid`` per client uid; a connection beyond them is answered
``error RESOURCE_EXHAUSTED ...`` and closed. Thread-safety: ``start``/``close`` from one
thread; the acceptor and lane threads share only the registry under ``_lock``.
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
from pathlib import Path

from hicached_client.lane_wire import SUFFIX

from hicached.core.keyed import KeyedCache
from hicached.core.service import HiCacheCore
from hicached.server.lane import Lane, Refused
from hicached.server.observer import NullRpcObserver, RpcObserver

logger = logging.getLogger(__name__)

__all__ = ["LaneServer", "lane_path"]


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
        observe: RpcObserver | None = None,
    ) -> None:
        self._core = core
        self._keyed = keyed
        self._path = path
        self._mode = mode
        self._max_lanes = max_lanes
        self._max_per_session = max_per_session
        self._max_per_uid = max_per_uid
        self._observe: RpcObserver = observe or NullRpcObserver()
        self._lock = threading.Lock()
        self._threads: dict[Lane, threading.Thread] = {}
        self._per_session: Counter[str] = Counter()
        self._per_uid: Counter[int] = Counter()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._inode: tuple[int, int] | None = None

    @property
    def path(self) -> Path:
        return self._path

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()  # a stale socket of a dead daemon (the gRPC socket was free too)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o177)  # never reachable with wider permissions than configured
            try:
                listener.bind(str(self._path))
            finally:
                os.umask(old)
            os.chmod(self._path, self._mode)
            st = os.stat(self._path)
            self._inode = (st.st_dev, st.st_ino)
            listener.listen(64)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name="hicached-lane-accept", daemon=True)
        self._acceptor.start()
        logger.info("fast lane listening", extra={"event": "lane", "socket": str(self._path)})

    def _accept_loop(self) -> None:
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
                conn, _ = listener.accept()
            except OSError as exc:
                logger.warning("fast lane accept failed: %s", exc)
                continue
            with self._lock:
                full = len(self._threads) >= self._max_lanes
                if not full:
                    lane = Lane(
                        self._core,
                        self._keyed,
                        conn,
                        stop_fd=self._stop_r,
                        admit=self._admit,
                        release=self._release,
                        observe=self._observe,
                    )
                    thread = threading.Thread(
                        target=self._run, args=(lane,), name="hicached-lane", daemon=True
                    )
                    self._threads[lane] = thread
            if full:
                with contextlib.suppress(OSError):
                    conn.send(
                        f"error RESOURCE_EXHAUSTED {self._max_lanes} fast lanes are open "
                        "(server.fast_lane_max); use gRPC or retry later\n".encode()
                    )
                conn.close()
                continue
            thread.start()

    def _run(self, lane: Lane) -> None:
        try:
            lane.run()
        finally:
            with self._lock:
                self._threads.pop(lane, None)

    def _admit(self, lane: Lane, session_id: str, uid: int) -> None:
        """Count ``lane`` against its session's and its uid's limits (Refused when reached)."""
        with self._lock:
            if self._per_session[session_id] >= self._max_per_session:
                raise Refused(
                    "RESOURCE_EXHAUSTED",
                    f"session {session_id[:16]!r} already has {self._max_per_session} fast lanes "
                    "(server.fast_lane_max_per_session); close one or use gRPC",
                )
            if self._per_uid[uid] >= self._max_per_uid:
                raise Refused(
                    "RESOURCE_EXHAUSTED",
                    f"uid {uid} already has {self._max_per_uid} fast lanes (server.fast_lane_max_per_uid); "
                    "close one or use gRPC",
                )
            self._per_session[session_id] += 1
            self._per_uid[uid] += 1

    def _release(self, lane: Lane) -> None:
        with self._lock:
            self._per_session[lane.session_id] -= 1
            self._per_uid[lane.uid] -= 1
            # Drop zero counts: the counters hold only live sessions and uids.
            self._per_session += Counter()
            self._per_uid += Counter()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every lane (each finishes its current op), unlink our socket. Idempotent."""
        if self._stop_w < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")  # level-triggered: every poller sees it until we close
        if self._acceptor is not None:
            self._acceptor.join(timeout_s)
            self._acceptor = None
        with self._lock:
            threads = list(self._threads.values())
        deadline = time.monotonic() + timeout_s  # one budget for all lanes, not one each
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in threads) and self._stop_r >= 0:
            os.close(self._stop_r)  # no lane polls it any more
            os.close(self._stop_w)
            self._stop_r = self._stop_w = -1
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                st = os.stat(self._path)
                if (st.st_dev, st.st_ino) == self._inode:
                    self._path.unlink()
