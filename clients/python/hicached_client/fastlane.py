"""The client half of the fast lane: a session's hot calls over shared memory.

Write, Load, ResolveTransfers, ReleaseTransfers, and GetPages/PutPages with given keys.

``FastLane.open(session)`` connects to ``<socket>.lane`` next to the session's gRPC
socket, presents the session id and secret, and receives the ring (a sealed memfd) and
three eventfds. Each op is one record in the ring, one doorbell write and one wait for
the completion: no HTTP/2, no protobuf, no thread hop in the client. Results and errors
are the Session's: :class:`~hicached_client.types.WriteResult`, ``LoadResult``,
``ResolveResult``, ``GetPagesResult``, ``PutPagesResult``, ``HiCacheError(code, message)``.

gRPC stays the contract: a daemon without the lane (``server.fast_lane = false``, TCP,
older daemon) makes ``open`` raise ``HiCacheError(UNAVAILABLE)``; callers fall back to the
session's gRPC methods. After any ``UNAVAILABLE`` from an op the lane is closed.

Thread-safety: ops on one lane are serialised by a lock (one round trip at a time per
lane; open one lane per thread for parallelism). :meth:`start_load` returns before the copy
ends so a worker can wait for single layers (:meth:`PendingLoad.wait_layer`) while it runs.
Buffers: the ring is owned by the lane and unmapped by :meth:`close` (idempotent).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import grpc
import numpy as np

from hicached_client import _lane_common as lc
from hicached_client import lane_wire as w
from hicached_client._handoff import check_daemon, handoff_path
from hicached_client.errors import HiCacheError
from hicached_client.types import (
    GetPagesResult,
    LoadResult,
    LookupResult,
    PutPagesResult,
    ResolveResult,
    Transfer,
    WriteResult,
)

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def lane_path(target: str) -> str | None:
    """The lane socket next to a ``unix:`` target's socket; None for TCP targets."""
    fds = handoff_path(target)
    return None if fds is None else fds[: -len(".fds")] + w.SUFFIX


class FastLane:
    """One open lane of one session (see the module docstring)."""

    def __init__(self, conn: socket.socket, fds: list[int], *, session_id: str) -> None:
        self._conn = conn
        self.session_id = session_id
        memfd, self._submit, self._done, self._layer = fds
        try:
            lc.check_received(memfd, fds[1:])
            self._ring = mmap.mmap(memfd, w.RING_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                with memoryview(self._ring) as header:
                    w.check_ring(header)
            except w.RecordError as exc:
                self._ring.close()
                raise lc.unavailable(f"the daemon's lane ring: {exc}") from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        os.close(memfd)
        self._view = memoryview(self._ring)
        self._counters = np.frombuffer(self._ring, dtype=np.int64, count=w.LAYER_SEQ // 8)
        self.layer_seq = np.frombuffer(self._ring, dtype=np.int64, count=w.MAX_LAYERS, offset=w.LAYER_SEQ)
        self.layer_ns = np.frombuffer(self._ring, dtype=np.int64, count=w.MAX_LAYERS, offset=w.LAYER_NS)
        self._lock = threading.RLock()
        self._tail = 0  # next seq to submit
        self._collected = 0  # next seq whose completion is read
        self._results: dict[int, w.Completion] = {}
        self._poller = select.poll()
        self._poller.register(self._done, select.POLLIN)
        self._poller.register(conn.fileno(), select.POLLIN)
        self._closed = False
        # Microseconds to spin on the completion counter before sleeping on the doorbell: lower
        # latency where a core is free, wasted CPU where none is (default: sleep at once).
        self.spin_us = 0.0

    # ------------------------------------------------------------ opening and closing

    @classmethod
    def open(cls, session: Any, *, timeout_s: float = 5.0) -> FastLane:
        """A lane for ``session`` (a ``Session`` or ``AsyncSession``: its target, id and secret)."""
        path = lane_path(session.client.target)
        if path is None:
            raise lc.unavailable(
                f"no fast lane over TCP ({session.client.target}); use the session's gRPC calls"
            )
        return cls.connect(path, session.session_id, session.info.session_secret, timeout_s=timeout_s)

    @classmethod
    def connect(cls, path: str, session_id: str, secret: str, *, timeout_s: float = 5.0) -> FastLane:
        """Negotiate a lane at the lane socket ``path`` (HiCacheError with the daemon's code if refused)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            conn.settimeout(timeout_s)
            try:
                conn.connect(path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise lc.unavailable(f"no fast lane socket at {path} ({exc}); use gRPC") from None
            # The session's secret goes only to a daemon this process trusts (as its buffers do).
            check_daemon(conn, path, what="fast lane", refusing="send the session's secret")
            # Refused at accept (all lanes taken), the daemon has answered and closed: the
            # send fails, and its answer is read below.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.sendall(b" ".join([w.NEGOTIATE_MAGIC, session_id.encode(), secret.encode()]) + b"\n")
            msg, fds, _, _ = socket.recv_fds(conn, w.MAX_NEGOTIATE, 4)
            if msg.startswith(b"ok ") and len(fds) == 4:
                conn.setblocking(False)
                return cls(conn, list(fds), session_id=session_id)
            for fd in fds:
                os.close(fd)
            text = msg.decode("utf-8", "replace").strip()
            code = grpc.StatusCode.UNAVAILABLE
            if text.startswith("error "):
                name, _, text = text[len("error ") :].partition(" ")
                got = getattr(grpc.StatusCode, name, None) if name.isupper() else None
                code = got if isinstance(got, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
            raise HiCacheError(
                code, f"the daemon refused the fast lane: {text or 'no answer'}", method="FastLane"
            )
        except TimeoutError:
            conn.close()
            raise HiCacheError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"fast lane negotiation at {path} timed out"
            ) from None
        except OSError as exc:
            conn.close()
            raise lc.unavailable(f"fast lane negotiation at {path} failed: {exc}") from None
        except BaseException:
            conn.close()
            raise

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Tear the lane down. Idempotent.

        Waits (at most ``timeout_s``: the daemon first finishes an op it is running) until the
        daemon has released its side, so a new lane opened right after counts against the
        limits without this one.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            del self._counters, self.layer_seq, self.layer_ns
            self._view.release()
            self._ring.close()
            for fd in (self._submit, self._done, self._layer):
                os.close(fd)
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_WR)  # the daemon sees EOF, tears down, closes
                eof = select.poll()  # not select(): a descriptor past 1,023 is out of its range
                eof.register(self._conn.fileno(), select.POLLIN)
                if eof.poll(int(timeout_s * 1000)):
                    self._conn.recv(1)
            self._conn.close()

    def abandon(self) -> None:
        """An op was given up before its completion came (a timeout, a cancelled wait): close
        the lane at once, without waiting for the daemon. Its caller may reuse the op's pages
        and staging as soon as it is told the op failed, so the daemon must never run that op
        later: it checks the connection before each request it takes, and runs none after
        this close (one it is already running still finishes, as a gRPC call past its
        deadline does). Idempotent."""
        self.close(timeout_s=0)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def wake_fds(self) -> tuple[int, int]:
        """(completion doorbell, connection to the daemon), for a caller that waits on an event
        loop instead of :meth:`completion`: the first is readable when a completion may have been
        published (reset it with :func:`_lane_common.drain`), the second when the daemon closed
        the lane. The lane owns both; they are closed by :meth:`close`."""
        return self._done, self._conn.fileno()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------ ops

    def write(
        self,
        transfers: Sequence[Transfer],
        *,
        allocate: bool = False,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> WriteResult:
        """Device -> host copy, as :meth:`Session.write` (no primary pages: name the anchor pool)."""
        flags = w.FLAG_ALLOCATE if allocate else 0
        return lc.write_result(self._call(w.Opcode.WRITE, flags, transfers, op_id, timeout_s))

    def load(
        self,
        transfers: Sequence[Transfer],
        *,
        layer_progress: bool = True,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LoadResult:
        """Host -> device copy, as :meth:`Session.load_wait`; ``layers`` in the order they landed.
        The wait for the lane counts against ``timeout_s``, as every op's (:meth:`start_load`
        is the raw submit, for callers that wait on layers)."""
        flags = w.FLAG_LAYER_PROGRESS if layer_progress else 0
        return lc.load_result(self._call(w.Opcode.LOAD, flags, transfers, op_id, timeout_s))

    def start_load(
        self, transfers: Sequence[Transfer], *, layer_progress: bool = True, op_id: str | None = None
    ) -> PendingLoad:
        """Submit a Load and return at once; wait for layers or the end on the result."""
        flags = w.FLAG_LAYER_PROGRESS if layer_progress else 0
        return PendingLoad(self, self.submit_raw(lc.request(w.Opcode.LOAD, flags, transfers, op_id)))

    def resolve_transfers(
        self, transfers: Sequence[Transfer], *, op_id: str | None = None, timeout_s: float | None = None
    ) -> ResolveResult:
        return lc.resolve_result(self._call(w.Opcode.RESOLVE, 0, transfers, op_id, timeout_s))

    def release_transfers(
        self, transfers: Sequence[Transfer], *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        return self._call(w.Opcode.RELEASE, 0, transfers, op_id, timeout_s).value

    def get_pages(
        self,
        keys: Sequence[str],
        transfers: Sequence[Transfer],
        *,
        include_l3: bool = False,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> GetPagesResult:
        """As :meth:`Session.get_pages` with a list of keys (no token chain, no primary pages)."""
        flags = w.FLAG_INCLUDE_L3 if include_l3 else 0
        c = self._call(w.Opcode.GET_PAGES, flags, transfers, op_id, timeout_s, keys)
        return lc.get_pages_result(c)

    def put_pages(
        self,
        keys: Sequence[str],
        transfers: Sequence[Transfer],
        *,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PutPagesResult:
        """As :meth:`Session.put_pages` with a list of keys (no token chain, primary pages or fence)."""
        c = self._call(w.Opcode.PUT_PAGES, 0, transfers, op_id, timeout_s, keys)
        return lc.put_pages_result(c, len(keys))

    def lookup(self, keys: Sequence[str], *, timeout_s: float | None = None) -> LookupResult:
        """As :meth:`Session.lookup` with a list of keys (the session's tenant)."""
        return lc.lookup_result(self._call(w.Opcode.LOOKUP, 0, (), None, timeout_s, keys), keys)

    def ping(self, *, timeout_s: float | None = None) -> None:
        """One round trip that does no work in the daemon (the lane's own latency)."""
        self._call(w.Opcode.PING, 0, (), None, timeout_s)

    # ------------------------------------------------------------ ring mechanics

    def _call(
        self,
        opcode: w.Opcode,
        flags: int,
        transfers: Sequence[Transfer],
        op_id: str | None,
        timeout_s: float | None,
        keys: Sequence[str] = (),
    ) -> w.Completion:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # Another thread's op may hold the lane: the wait for it counts against this op's
        # timeout (nothing is sent if it runs out: the op can be sent again).
        if not self._lock.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            raise lc.timed_out()
        try:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left < lc.MIN_SEND_S:
                raise lc.timed_out()  # nothing sent (the lane stays open): the op can be sent again
            seq = self.submit_raw(lc.request(opcode, flags, transfers, op_id, keys))
            return self.completion(seq, left)
        finally:
            self._lock.release()

    def submit_raw(self, fill: lc.Fill) -> int:
        """Publish one request written by ``fill(view, offset, seq)`` (:func:`_lane_common.request`
        writes an op's); returns its seq. Thread-safe (under the lane's lock); the caller then
        collects the completion (:meth:`completion`) before :data:`lane_wire.SLOTS` more are
        in flight. Tests use it to send hostile records.
        """
        with self._lock:
            if self._closed:
                raise lc.unavailable("the fast lane is closed")
            seq = self._tail
            if seq - self._collected >= w.SLOTS:
                raise RuntimeError(f"{w.SLOTS} ops are already in flight on this lane: collect one first")
            fill(self._view, w.request_offset(seq), seq)
            self._tail = seq + 1
            self._counters[w.SQ_TAIL // 8] = self._tail
            os.eventfd_write(self._submit, 1)
            return seq

    def published(self, seq: int) -> bool:
        """True once the completion of ``seq`` is in the ring (never blocks)."""
        with self._lock:
            if self._closed:
                raise lc.unavailable("the fast lane is closed")
            return self._collected > seq or int(self._counters[w.CQ_TAIL // 8]) > seq

    def completion(self, seq: int, timeout_s: float | None = None) -> w.Completion:
        """Wait for and decode the completion of ``seq``; raises HiCacheError for an error status."""
        c = self.raw_completion(seq, timeout_s)
        if c.status != 0:
            code = _CODES.get(c.status, grpc.StatusCode.UNKNOWN)
            raise HiCacheError(code, c.message, retry_after_ms=c.retry_after_ms, method="FastLane")
        return c

    def raw_completion(self, seq: int, timeout_s: float | None = None) -> w.Completion:
        """The completion record of ``seq`` as sent (errors included)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._collected <= seq:
                if self._closed:
                    raise lc.unavailable("the fast lane is closed")
                if int(self._counters[w.CQ_TAIL // 8]) > self._collected or self._spin():
                    s = self._collected
                    self._results[s] = self._read(s)
                    self._collected += 1
                    continue
                self._sleep(deadline)
            return self._results.pop(seq)

    def _read(self, seq: int) -> w.Completion:
        """The completion of ``seq``; a record that is not one (the other side is no daemon of
        ours, or a broken one) closes the lane: UNAVAILABLE, so the session goes on over gRPC."""
        try:
            c = w.read_completion(self._view, w.completion_offset(seq))
            if c.seq != seq:
                raise w.RecordError(f"completion of seq {c.seq} in the slot of seq {seq}")
        except w.RecordError as exc:
            self.close(timeout_s=0)
            raise lc.unavailable(
                f"the daemon wrote a malformed fast lane completion ({exc}); lane closed"
            ) from None
        return c

    def _spin(self) -> bool:
        """Poll the completion counter for up to ``spin_us`` before sleeping on the doorbell."""
        if self.spin_us <= 0:
            return False
        counters, collected = self._counters, self._collected
        end = time.perf_counter() + self.spin_us / 1e6
        while time.perf_counter() < end:
            if int(counters[w.CQ_TAIL // 8]) > collected:
                return True
        return False

    def _sleep(self, deadline: float | None) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            self.abandon()
            raise lc.timed_out()
        gone = False
        for fd, _ in self._poller.poll(None if left is None else max(1, int(left * 1000))):
            if fd == self._done:
                lc.drain(self._done)
            else:
                gone = True
        # The daemon writes its last completions before it hangs up: read them first (the
        # EOF and their doorbell may wake one poll, or the EOF alone). As AsyncFastLane does.
        if gone and int(self._counters[w.CQ_TAIL // 8]) <= self._collected:
            self.close()
            raise lc.closed_by_daemon()

    def wait_layer_event(self, timeout_s: float) -> bool:
        """Block until the layer doorbell rings (or ``timeout_s``); for waiters that do not spin."""
        with self._lock:
            if self._closed:
                raise lc.unavailable("the fast lane is closed")
            layer = select.poll()  # not select(): a descriptor past 1,023 is out of its range
            layer.register(self._layer, select.POLLIN)
        ready = layer.poll(int(timeout_s * 1000))
        if ready:
            with contextlib.suppress(OSError):  # closed meanwhile: the next check says so
                lc.drain(self._layer)
        return bool(ready)


class PendingLoad:
    """A submitted Load: per-layer waits (a counter in the ring) and the final result."""

    def __init__(self, lane: FastLane, seq: int) -> None:
        self.lane = lane
        self.seq = seq

    def layer_landed(self, layer: int) -> bool:
        """True once ``layer`` of this load is on the device (one load of shared memory)."""
        return int(self._counters()[0][layer]) == self.seq + 1

    def _counters(self) -> tuple[Any, Any]:
        """The ring's layer counters; UNAVAILABLE once the lane is closed (an op was given up
        on, or the daemon closed it): the load's result then says how it ended."""
        seq, ns = getattr(self.lane, "layer_seq", None), getattr(self.lane, "layer_ns", None)
        if seq is None or ns is None:
            raise lc.unavailable("the fast lane is closed")
        return seq, ns

    def wait_layer(self, layer: int, *, timeout_s: float = 10.0, spin: bool = True) -> int:
        """Wait until ``layer`` landed; returns the daemon's CLOCK_MONOTONIC ns of the landing.

        ``spin`` polls the counter (lowest delay, burns a core); otherwise sleeps on the
        layer doorbell between checks.
        """
        deadline = time.monotonic() + timeout_s
        # The counters are looked up on each check, never kept: a close (another thread giving
        # up on an op) cannot unmap a ring whose memory a view still exports.
        while not self.layer_landed(layer):
            if time.monotonic() > deadline:
                raise HiCacheError(grpc.StatusCode.DEADLINE_EXCEEDED, f"layer {layer} did not land in time")
            if not spin:
                self.lane.wait_layer_event(0.01)
        return int(self._counters()[1][layer])

    def result(self, timeout_s: float | None = None) -> LoadResult:
        return lc.load_result(self.lane.completion(self.seq, timeout_s))


__all__ = ["FastLane", "PendingLoad", "lane_path"]
