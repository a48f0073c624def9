"""The Prometheus /metrics endpoint: one thread, one selector, every resource bounded.

prometheus_client's ``start_http_server`` started a thread per connection, with no deadline
and a listen backlog of 5: a stranger who could reach the port held a daemon thread (and, in
header lines, up to 6.3 MiB) per connection for ever, and 1,500 half-sent requests ended at
once rendered the exposition 1,500 times over, starving the event loop of the GIL for 11-69 s
(sessions expired, health checks failed). Here one thread serves every connection, and a
stranger's connection costs a socket, a slot and a few microseconds of that thread:

* at most :data:`MAX_CONNECTIONS` at once; one more replaces the oldest already answered,
  else the oldest still sending its request, else the oldest: idle connections cannot lock
  Prometheus out (whose request, there at the accept, is answered before the next accept);
* the whole request head within :data:`HEAD_TIMEOUT_S` of the accept, at most
  :data:`MAX_HEAD_BYTES` (431 beyond); GET or HEAD of ``/metrics`` or ``/`` (405, 404, 400
  otherwise, fixed bodies that echo nothing); one answer per connection, then it is closed;
* the whole answer taken within :data:`ANSWER_TIMEOUT_S`, else the reader is dropped;
* one render per format per :data:`CACHE_TTL_S` (gzip'd once more when asked), shared by
  every answer: a flood of scrapes costs one render a second;
* an accept out of descriptors pauses, as the daemon's other listeners (:mod:`hicached.accept`).

Thread-safety: :func:`start` and :meth:`MetricsServer.close` may be called from any thread
(close once or more); everything else runs on the server's own thread, which reads the
registry (prometheus_client is thread-safe). Buffer ownership: an answer's body is the
cache's immutable ``bytes``, shared by every connection sending it (never copied per
connection); a connection owns only its head buffer (at most :data:`MAX_HEAD_BYTES`).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import logging
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from hicached.accept import ACCEPT_PAUSE_S, AcceptPauses

logger = logging.getLogger(__name__)

__all__ = [
    "ACCEPT_PAUSE_S",
    "ANSWER_TIMEOUT_S",
    "CACHE_TTL_S",
    "HEAD_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_HEAD_BYTES",
    "MetricsServer",
    "start",
]

# Prometheus scrapes a target every 15-60 s over one connection; a few operators' curls
# beside it fit many times over.
MAX_CONNECTIONS = 32
# Seconds from accept to the blank line ending the request head (the whole head, not per read).
HEAD_TIMEOUT_S = 5.0
# Seconds from the request to the last byte of the answer handed to the kernel; Prometheus'
# default scrape_timeout is 10 s, so a reader slower than that has been given up by it anyway.
ANSWER_TIMEOUT_S = 10.0
# A scraper's request head is ~200 bytes; beyond this it is 431.
MAX_HEAD_BYTES = 8192
# How long one render is served before the next; a flood costs one render per format a second.
CACHE_TTL_S = 1.0
BACKLOG = 128
# Accepts per wake-up: then the connections' own reads, so that a flood of connections needs
# several rounds, each reading every waiting head first, to replace a scraper's connection.
ACCEPT_BATCH = 4
# After an answer, what is read and dropped before the close (so that the kernel does not
# reset the connection over unread bytes and lose the answer), and for how long at most.
LINGER_BYTES = 64 * 1024
LINGER_S = 1.0
_READ = 4096
_PATHS = frozenset({"/metrics", "/"})
_WAKE = "wake"  # the selector key data of close()'s wake-up socket; the listener's is None

Format = Literal["text", "openmetrics"]


def _status(code: int, reason: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    ).encode() + body


# Fixed answers: nothing a client sent is echoed back.
BAD_REQUEST = _status(400, "Bad Request", b"bad request\n")
NOT_FOUND = _status(404, "Not Found", b"not found; metrics are at /metrics\n")
NOT_ALLOWED = _status(405, "Method Not Allowed", b"only GET and HEAD\n", "Allow: GET, HEAD\r\n")
TOO_LARGE = _status(431, "Request Header Fields Too Large", b"request head over 8 KiB\n")
FAILED = _status(500, "Internal Server Error", b"rendering the metrics failed; see the daemon log\n")


@dataclass
class _Conn:
    """One connection: reading its head, then sending its answer, then lingering."""

    sock: socket.socket
    accepted: float
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    out: list[memoryview] = field(default_factory=list)  # what is left to send
    answering: bool = False
    lingering: int = -1  # bytes still to drop after the answer; -1: not answered yet


class _Exposition:
    """The rendered answers, by format and encoding, each served for :data:`CACHE_TTL_S`.

    Not thread-safe: used by the server's thread only.
    """

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float]) -> None:
        self._registry = registry
        self._clock = clock
        self._cache: dict[tuple[Format, bool], tuple[float, bytes]] = {}

    def get(self, fmt: Format, gzipped: bool) -> bytes:
        now = self._clock()
        hit = self._cache.get((fmt, gzipped))
        if hit is not None and now < hit[0]:
            return hit[1]
        if gzipped:
            body = gzip.compress(self.get(fmt, False), compresslevel=6)
        elif fmt == "openmetrics":
            body = openmetrics.generate_latest(self._registry)  # type: ignore[no-untyped-call]
        else:
            body = generate_latest(self._registry)
        self._cache[(fmt, gzipped)] = (now + CACHE_TTL_S, body)
        return body


def _wants_gzip(value: str) -> bool:
    for coding in value.split(","):
        name, _, params = coding.partition(";")
        if name.strip().lower() == "gzip":
            return params.replace(" ", "").lower() not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


def _answer(head: bytes, exposition: _Exposition) -> tuple[bytes, ...]:
    """The answer to one complete request head: a refusal (one fixed ``bytes``), or the
    metrics as (status line and headers, body)."""
    lines = head.replace(b"\r\n", b"\n").split(b"\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return (BAD_REQUEST,)
    method, target = parts[0], parts[1].decode("latin-1")
    headers = _headers(lines[1:])
    answer = (BAD_REQUEST,) if headers is None else _route(method, target, headers, exposition)
    if method == b"HEAD":  # the head a GET gets, no body (RFC 9110, 9.3.2)
        return (answer[0][: answer[0].index(b"\r\n\r\n") + 4],)
    return answer


def _headers(lines: list[bytes]) -> dict[bytes, str] | None:
    """The header fields by lower-case name; None when a line is not one."""
    headers: dict[bytes, str] = {}
    for line in lines:
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            return None
        headers[name.strip().lower()] = value.strip().decode("latin-1")
    return headers


def _route(
    method: bytes, target: str, headers: dict[bytes, str], exposition: _Exposition
) -> tuple[bytes, ...]:
    if method not in (b"GET", b"HEAD"):
        return (NOT_ALLOWED,)
    try:
        path = urlsplit(target).path
    except ValueError:  # "//[x": an invalid IPv6 authority
        return (BAD_REQUEST,)
    if path not in _PATHS:
        return (NOT_FOUND,)
    fmt: Format = "openmetrics" if "application/openmetrics-text" in headers.get(b"accept", "") else "text"
    gzipped = _wants_gzip(headers.get(b"accept-encoding", ""))
    try:
        body = exposition.get(fmt, gzipped)
    except Exception:
        logger.exception("rendering /metrics failed", extra={"event": "metrics"})
        return (FAILED,)
    content_type = openmetrics.CONTENT_TYPE_LATEST if fmt == "openmetrics" else CONTENT_TYPE_PLAIN_0_0_4
    encoding = "Content-Encoding: gzip\r\n" if gzipped else ""
    status = (
        f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        f"{encoding}Connection: close\r\n\r\n"
    ).encode()
    return (status, body)


class MetricsServer:
    """A running endpoint: ``port`` is the bound one (``0`` asked: any free port), ``thread``
    the one serving it. Built and started by :func:`start`; :meth:`close` from any thread."""

    def __init__(
        self,
        listener: socket.socket,
        registry: CollectorRegistry,
        *,
        on_failure: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._listener = listener
        self.port: int = int(listener.getsockname()[1])
        self._exposition = _Exposition(registry, clock)
        self._on_failure = on_failure
        self._clock = clock
        self._conns: dict[socket.socket, _Conn] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the selector
        self._wake_w.setblocking(False)
        self._stopping = False
        self._resume_at: float | None = None  # accepts paused (out of descriptors) until then
        self._pauses = AcceptPauses("metrics", "metrics", clock=clock)
        self._closed = False
        self._close_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="hicached-metrics", daemon=True)

    @property
    def accept_pauses(self) -> int:
        """Accepts paused for want of descriptors so far (read from any thread; an int)."""
        return self._pauses.count

    def close(self) -> None:
        """Stop serving, drop every connection, release the port and join the thread;
        a second call is a no-op."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self.thread.is_alive():
            self.thread.join()
        else:  # never started, or ended: release what the thread would have
            self._release()

    def _run(self) -> None:
        """The server's thread: never dies while the server is open. A failure of one step
        is logged and counted (``on_failure``), and serving goes on after a short pause."""
        sel = self._selector
        sel.register(self._listener, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        try:
            while not self._stopping:
                try:
                    self._step()
                except Exception:
                    logger.exception("metrics endpoint failed; serving again", extra={"event": "task_failed"})
                    if self._on_failure is not None:
                        self._on_failure()
                    self._wait(ACCEPT_PAUSE_S)  # a persistent fault must not spin
        finally:
            self._release()

    def _wait(self, seconds: float) -> None:
        """Up to ``seconds``, or until :meth:`close` (not the selector: a listener that stays
        readable would end the pause at once)."""
        select.select([self._wake_r], [], [], seconds)

    def _release(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        with contextlib.suppress(Exception):
            self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def _step(self) -> None:
        now = self._clock()
        if self._resume_at is not None and now >= self._resume_at:
            self._resume_at = None
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        wake = [c.deadline for c in self._conns.values()]
        if self._resume_at is not None:
            wake.append(self._resume_at)
        timeout = max(0.0, min(wake) - now) if wake else None
        events = self._selector.select(timeout)
        accept = False
        for key, _ in events:
            if key.data is _WAKE:
                return
            if key.data is None:
                accept = True  # after the connections' own events: an answer before a new slot
                continue
            conn: _Conn = key.data
            if self._conns.get(conn.sock) is conn:  # not replaced earlier in this round
                self._serve(conn)
        if accept:
            self._accept()
        now = self._clock()
        for late in [c for c in self._conns.values() if c.deadline <= now]:
            logger.debug("metrics connection past its deadline dropped", extra={"event": "metrics"})
            self._drop(late)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._accept_failed(exc)
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                self._drop(self._victim())
            sock.setblocking(False)
            now = self._clock()
            conn = _Conn(sock, now, now + HEAD_TIMEOUT_S)
            self._conns[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            # A scraper's head is usually here already: answer it now, before more accepts
            # can replace it.
            self._serve(conn)

    def _victim(self) -> _Conn:
        """The connection a new one replaces, oldest first: one already answered (waiting for
        its client to close), else one still sending its request head, else any."""
        conns = list(self._conns.values())
        done = [c for c in conns if c.lingering >= 0]
        waiting = done or [c for c in conns if not c.answering] or conns
        return min(waiting, key=lambda c: c.accepted)

    def _accept_failed(self, exc: OSError) -> None:
        if self._pauses.failed(exc):  # out of descriptors: the listener sleeps (hicached.accept)
            self._selector.unregister(self._listener)
            self._resume_at = self._clock() + ACCEPT_PAUSE_S

    def _serve(self, conn: _Conn) -> None:
        try:
            if conn.lingering >= 0:
                self._linger(conn)
            elif conn.answering:
                self._send(conn)
            else:
                self._read(conn)
        except (BlockingIOError, InterruptedError):
            pass  # nothing yet (a read right after the accept): the selector tells when
        except OSError as exc:  # reset by the peer, broken pipe: its loss
            logger.debug("metrics connection failed: %s", exc, extra={"event": "metrics"})
            self._drop(conn)
        except Exception:  # a request this code did not foresee: its connection goes, not the server
            logger.warning(
                "metrics request failed; connection dropped", exc_info=True, extra={"event": "metrics"}
            )
            self._drop(conn)

    def _read(self, conn: _Conn) -> None:
        data = conn.sock.recv(_READ)
        if not data:  # closed before its head ended: nothing to answer
            self._drop(conn)
            return
        start = max(0, len(conn.head) - 3)
        conn.head += data
        end = conn.head.find(b"\r\n\r\n", start)
        size = end + 4
        if end < 0:
            end = conn.head.find(b"\n\n", start)
            size = end + 2
        if end < 0:
            if len(conn.head) > MAX_HEAD_BYTES:
                self._respond(conn, (TOO_LARGE,))
            return
        if size > MAX_HEAD_BYTES:
            self._respond(conn, (TOO_LARGE,))
            return
        self._respond(conn, _answer(bytes(conn.head[:end]), self._exposition))

    def _respond(self, conn: _Conn, answer: tuple[bytes, ...]) -> None:
        conn.head = bytearray()
        conn.answering = True
        conn.deadline = self._clock() + ANSWER_TIMEOUT_S
        conn.out = [memoryview(part) for part in answer if part]
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.sendmsg(conn.out)
            except (BlockingIOError, InterruptedError):
                return  # the selector says when it can take more
            while sent:
                first = conn.out[0]
                if sent < len(first):
                    conn.out[0] = first[sent:]
                    break
                sent -= len(first)
                conn.out.pop(0)
        # All handed to the kernel. Closing now would reset the connection if the client
        # sent more than its head (a body, a refused oversized head) and lose the answer:
        # end our side, then read and drop what comes until the client closes, for
        # LINGER_S and LINGER_BYTES at most.
        conn.sock.shutdown(socket.SHUT_WR)
        conn.lingering = LINGER_BYTES
        conn.deadline = min(conn.deadline, self._clock() + LINGER_S)
        self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _linger(self, conn: _Conn) -> None:
        data = conn.sock.recv(_READ)
        conn.lingering -= len(data)
        if not data or conn.lingering < 0:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        conn.out = []
        conn.sock.close()


def start(
    registry: CollectorRegistry, host: str, port: int, *, on_failure: Callable[[], None] | None = None
) -> MetricsServer:
    """Listen on ``host:port`` (``0``: any free port) and serve ``registry`` on a thread of its
    own until :meth:`MetricsServer.close`. Raises :class:`OSError` (a port in use, a host that
    does not resolve) with nothing left open."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(BACKLOG)
        listener.setblocking(False)
        server = MetricsServer(listener, registry, on_failure=on_failure)
    except BaseException:
        listener.close()
        raise
    try:
        server.thread.start()
    except RuntimeError as exc:  # "can't start new thread": at a pids limit, say
        server.close()  # never started: releases the listener and the wake-up pair
        raise OSError(errno.EAGAIN, f"cannot start the metrics thread ({exc})") from exc
    return server
