"""One fast lane: a session's ring in shared memory, served by one daemon thread.

A lane is born on a connection to ``<socket>.lane`` (see :mod:`hicached.server.fastlane`).
Its thread reads ONE line ``hicached-lane-v1 <session_id> <session_secret>\\n``, checks it
exactly as gRPC checks a session call (``core.check_secret``: constant-time) and, in
addition, that the kernel's ``SO_PEERCRED`` uid is the uid bound to the session at attach.
It then creates a sealed memfd (the ring, layout in :mod:`hicached_client.lane_wire`) and
three eventfds (submit doorbell, completion doorbell, layer doorbell) and sends them with
``ok v1\\n`` over ``SCM_RIGHTS``; a refusal is ``error <STATUS_CODE> <reason>\\n``.

Serving: the thread sleeps in ``poll`` on the submit doorbell, the connection (EOF = the
client is gone) and the server's stop fd; it copies each request out of shared memory once,
decodes it as hostile input and runs it through the same core calls the gRPC servicer makes
(``core.write``/``load``/``resolve``/``release``, ``keyed.get_pages``/``put_pages``/``lookup``:
same validation, authorization by session, op-id idempotency and accounting), then writes the
completion and rings the client. A GetPages or Lookup that reaches L3 runs on this lane's thread,
so it waits for no other client's L3 calls and holds up only its own session's lane. A Load's
layers are published as they land: ``layer_seq[l] = seq`` and ``layer_ns[l]`` in the ring,
plus the layer doorbell.

Teardown (client closes or dies, session ends, daemon stops, ring corrupted): the thread
finishes the op it is running, then unmaps the ring and closes the eventfds and the connection
exactly once. Thread-safety: everything here runs on the lane's own thread, except
``on_layer`` (the copy engine's thread), which only stores to the ring and writes an eventfd.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
from hicached_client import lane_wire as w

from hicached.config import LimitsConfig
from hicached.core.keyed import KeyedCache
from hicached.core.service import HiCacheCore
from hicached.core.sessions import Session
from hicached.errors import PermissionDenied
from hicached.l2.group import PoolTransfer
from hicached.server.handoff import peer_cred
from hicached.server.lane_records import acks_out, check_answer_fits, transfers_in, transfers_out
from hicached.server.limits import check_id_values, check_keys
from hicached.server.observer import RpcObserver
from hicached.server.status import Answer, answer_for

logger = logging.getLogger(__name__)

NEGOTIATE_TIMEOUT_S = 2.0
# How often a sleeping lane checks whether its session has ended.
SESSION_CHECK_MS = 250
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Refused(Exception):
    """A negotiation the daemon declines; ``code`` is the gRPC status name sent back."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RingViolation(Exception):
    """The client broke the ring protocol (counters out of range): the lane is closed."""


def _answer(exc: BaseException, method: str) -> Answer:
    """``exc``'s answer, as gRPC's error interceptor gives it for ``method`` (a bug logged alike)."""
    answer = answer_for(exc, method)
    if answer.log_it:
        logger.exception("internal error in %s", method, exc_info=exc)
    return answer


class Lane:
    """One lane's state; :meth:`run` is its thread's body (negotiate, serve, tear down)."""

    def __init__(
        self,
        core: HiCacheCore,
        keyed: KeyedCache,
        conn: socket.socket,
        *,
        stop_fd: int,
        admit: Callable[[Lane, str], None],
        release: Callable[[Lane, bool], None],
        observe: RpcObserver,
        limits: LimitsConfig,
    ) -> None:
        self._core = core
        self._keyed = keyed
        self._limits = limits
        self._conn = conn
        self._stop_fd = stop_fd
        self._admit = admit
        self._release = release
        self._observe = observe
        self.session_id = ""
        self._session: Session | None = None
        self._ring: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._counters: np.ndarray | None = None  # int64 view of the ring header
        self._layer_seq: np.ndarray | None = None
        self._layer_ns: np.ndarray | None = None
        self._efds: list[int] = []  # submit, complete, layer
        self._head = 0
        self._pools = 0  # of the session's group, set at negotiation
        self._admitted = False
        self._client_gone = True  # until the lane ends for another reason (see _teardown)
        # displace() (the acceptor's thread) and the close in _teardown: a close between its
        # fd lookup and its syscall could make it shut down a descriptor reused by then.
        self._conn_lock = threading.Lock()

    # ------------------------------------------------------------ lifetime

    def run(self) -> None:
        try:
            try:
                self._negotiate()
            except Refused as exc:
                with contextlib.suppress(OSError):
                    self._conn.sendall(f"error {exc.code} {str(exc)[:300]}\n".encode())
                return
            reason = self._serve()
            self._client_gone = reason in ("client closed", "ring violation")
            logger.debug(
                "fast lane closed", extra={"event": "lane", "session": self.session_id, "why": reason}
            )
        except Exception:
            logger.exception("fast lane failed", extra={"event": "lane", "session": self.session_id})
        finally:
            self._teardown()

    def _teardown(self) -> None:
        # numpy views and the memoryview export the mapping's buffer: drop them before unmapping.
        self._counters = self._layer_seq = self._layer_ns = None
        if self._view is not None:
            with contextlib.suppress(BufferError):  # a slice of it may still live (see below)
                self._view.release()
            self._view = None
        ring, self._ring = self._ring, None
        if ring is not None:
            # The client keeps the memfd: unmapped, the pages this thread faulted in (any record
            # may declare ~1 MiB it never wrote) would stay charged to the daemon, lane after
            # lane. The completions stay where the client may still read its last one.
            spans = (
                [(0, w.RING_BYTES)]
                if self._client_gone
                else [(w.request_offset(i), w.AREA) for i in range(w.SLOTS)]
            )
            with contextlib.suppress(OSError, ValueError):
                for offset, length in spans:
                    ring.madvise(mmap.MADV_REMOVE, offset, length)
            try:
                ring.close()
            except BufferError:
                # A failed copy's traceback may still hold a view (its on_layer); the mapping is
                # unmapped when the collector frees it. The rest must go now, whatever happens.
                logger.debug("fast-lane ring still referenced; unmapped when released")
        efds, self._efds = self._efds, []
        for fd in efds:
            with contextlib.suppress(OSError):
                os.close(fd)
        # Every exit path gives the lane's slots back (its uid's, counted at accept, and its
        # session's where admit() counted it), before the EOF below: the client's close()
        # waits for that EOF, so once it returns a new lane counts against every limit
        # without this one.
        admitted, self._admitted = self._admitted, False
        self._release(self, admitted)
        with self._conn_lock:
            self._conn.close()

    def displace(self, line: str) -> None:
        """From the acceptor's thread: a newcomer took this negotiating lane's slot. The client
        reads ``line``; the connection is shut down, so this lane's thread ends its negotiation
        at once (its admit is refused where it got past the read)."""
        with self._conn_lock, contextlib.suppress(OSError):  # closed or gone: nothing to tell
            self._conn.send(line.encode())
            self._conn.shutdown(socket.SHUT_RDWR)

    # ------------------------------------------------------------ negotiation

    def _read_line(self) -> bytes:
        # One deadline for the whole line: a peer sending a byte at a time must not hold a lane
        # slot (counted from accept) for longer than a whole line may take.
        deadline = time.monotonic() + NEGOTIATE_TIMEOUT_S
        data = b""
        try:
            while b"\n" not in data:
                if len(data) > w.MAX_NEGOTIATE:
                    raise Refused("INVALID_ARGUMENT", f"negotiation line longer than {w.MAX_NEGOTIATE} bytes")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._conn.settimeout(left)
                chunk = self._conn.recv(w.MAX_NEGOTIATE + 1 - len(data))
                if not chunk:
                    raise Refused("INVALID_ARGUMENT", "connection closed before the negotiation line")
                data += chunk
        except TimeoutError:
            raise Refused(
                "DEADLINE_EXCEEDED", f"no negotiation line within {NEGOTIATE_TIMEOUT_S} s"
            ) from None
        line, _, rest = data.partition(b"\n")
        if rest:  # the protocol is a line, then the daemon's answer: say so rather than wait
            raise Refused(
                "INVALID_ARGUMENT",
                f"{len(rest)} byte(s) after the negotiation line; send the line alone and wait for the answer",
            )
        return line + b"\n"

    def _negotiate(self) -> None:
        parts = self._read_line()[:-1].split(b" ")
        if len(parts) != 3 or parts[0] != w.NEGOTIATE_MAGIC:
            raise Refused(
                "INVALID_ARGUMENT",
                f"expected '{w.NEGOTIATE_MAGIC.decode()} <session_id> <session_secret>' (got {parts[0][:24]!r})",
            )
        session_id = parts[1].decode("ascii", "replace")
        secret = parts[2].decode("ascii", "replace")
        try:
            cred = peer_cred(self._conn)
        except OSError as exc:
            raise Refused("INTERNAL", f"cannot read peer credentials: {exc.strerror}") from None
        try:
            self._core.check_secret(session_id, secret)  # constant time, as on gRPC
            session, state = self._core.session_group(session_id)
        except Exception as exc:
            answer = _answer(exc, "FastLane")
            raise Refused(answer.code.name, answer.message) from None
        if session.peer is None or session.peer.uid != cred.uid:
            bound = "no kernel-verified uid (attached over TCP)" if session.peer is None else "another uid"
            raise Refused(
                "PERMISSION_DENIED",
                str(PermissionDenied(f"session {session_id[:16]!r} is bound to {bound}; a lane is only "
                                     f"opened to the uid that attached it (this peer is uid {cred.uid})")),
            )  # fmt: skip
        self.session_id = session_id
        self._session = session
        self._pools = len(state.group.entries)  # a group's pools are fixed for its life
        self._admit(self, session_id)  # raises Refused at the session's lane limit
        self._admitted = True
        try:
            fds = self._create_ring()
        except OSError as exc:  # out of descriptors or memory: the client is told, like any limit
            raise Refused(
                "RESOURCE_EXHAUSTED",
                f"the daemon cannot create this lane's ring: {exc.strerror or exc}; use gRPC or retry later",
            ) from None
        try:
            self._conn.settimeout(NEGOTIATE_TIMEOUT_S)
            socket.send_fds(self._conn, [b"ok v1\n"], fds)
        except OSError as exc:
            raise Refused("UNAVAILABLE", f"sending the lane failed: {exc}") from None
        finally:
            os.close(fds[0])  # the memfd: our mapping keeps the memory; the client got its own fd
        self._conn.setblocking(False)
        logger.info(
            "fast lane opened",
            extra={"event": "lane", "session": session_id, "peer_uid": cred.uid, "peer_pid": cred.pid},
        )

    def _create_ring(self) -> list[int]:
        memfd = os.memfd_create("hicached-lane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(memfd, w.RING_BYTES)
            # Sealed against resizing: the client can never make our mapping SIGBUS.
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _SEALS)
            self._ring = mmap.mmap(memfd, w.RING_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            for _ in range(3):
                self._efds.append(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
        except BaseException:
            os.close(memfd)
            raise
        self._view = memoryview(self._ring)
        w.init_ring(self._view)
        self._counters = np.frombuffer(self._ring, dtype=np.int64, count=w.LAYER_SEQ // 8)
        self._layer_seq = np.frombuffer(self._ring, dtype=np.int64, count=w.MAX_LAYERS, offset=w.LAYER_SEQ)
        self._layer_ns = np.frombuffer(self._ring, dtype=np.int64, count=w.MAX_LAYERS, offset=w.LAYER_NS)
        return [memfd, *self._efds]

    # ------------------------------------------------------------ serving

    def _serve(self) -> str:
        assert self._session is not None
        submit = self._efds[0]
        poller = select.poll()
        poller.register(submit, select.POLLIN)
        conn_fd = self._conn.fileno()
        poller.register(conn_fd, select.POLLIN)
        poller.register(self._stop_fd, select.POLLIN)
        self._conn_poll = select.poll()  # not select(): a descriptor past 1,023 is out of its range
        self._conn_poll.register(conn_fd, select.POLLIN)
        while True:
            try:
                if not self._drain():
                    return "client closed"
            except RingViolation as exc:
                logger.warning(
                    "fast lane closed: %s", exc, extra={"event": "lane", "session": self.session_id}
                )
                return "ring violation"
            if self._session.cancel.is_set():
                return "session ended"
            # More already pending (the client moved its tail while we served): look at the
            # stop fd and the connection first, without sleeping.
            busy = int(self._counters[w.SQ_TAIL // 8]) != self._head if self._counters is not None else False
            for fd, _ in poller.poll(0 if busy else SESSION_CHECK_MS):
                if fd == self._stop_fd:
                    return "daemon stopping"
                if fd == conn_fd:
                    return "client closed"  # EOF, reset or stray bytes: the lane ends either way
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(submit)

    def _drain(self) -> bool:
        """Serve the requests pending now (at most a ring's worth): a client that keeps moving
        its tail must not keep this thread from seeing its session end or the daemon stop.
        False once the client has closed the connection, checked before each request: a client
        closes when it gives up on an op (a timeout) and may reuse that op's pages at once, so
        no request this thread had not taken may run after (say the daemon was stopped)."""
        counters = self._counters
        assert counters is not None
        tail = int(counters[w.SQ_TAIL // 8])
        pending = tail - self._head
        if pending == 0:
            return True
        if not 0 < pending <= w.SLOTS:
            raise RingViolation(f"sq_tail {tail} with sq_head {self._head}: at most {w.SLOTS} may be pending")
        while self._head < tail:
            if not self._client_waits():
                return False
            self._complete(self._head)
            self._head += 1
            counters[w.SQ_HEAD // 8] = self._head
            counters[w.CQ_TAIL // 8] = self._head
            _ring_doorbell(self._efds[1])
        return True

    def _client_waits(self) -> bool:
        """No EOF (nor stray bytes) on the connection: the client has not closed the lane."""
        return not self._conn_poll.poll(0)

    def _complete(self, seq: int) -> None:
        view = self._view
        assert view is not None
        start = time.perf_counter()
        opcode = 0
        try:
            req = w.read_request(view, w.request_offset(seq), max_keys=self._limits.max_keys_per_request)
            opcode = int(req.opcode)
            if req.seq != seq:
                raise w.RecordError(f"record seq {req.seq} does not match its slot's sequence number {seq}")
            done = self._execute(req)
        except w.RecordError as exc:
            opcode = opcode or _opcode_of(view, seq)  # a known opcode's record refused in its parse
            done = w.Completion(
                opcode, seq, getattr(grpc.StatusCode, exc.code).value[0], False, None, str(exc)
            )
        except Exception as exc:
            # The answer gRPC gives the same error in the same RPC: one mapping for both.
            answer = _answer(exc, _RPC_NAMES.get(opcode, "FastLane"))
            done = w.Completion(
                opcode, seq, answer.code.value[0], False, answer.retry_after_ms, answer.message
            )
            # A copy's future may keep the exception: its frames (this one holds the ring's
            # view) must not keep the ring mapped after the lane ends.
            exc.__traceback__ = None
        try:
            w.encode_completion(view, w.completion_offset(seq), done)
        except ValueError as exc:  # unreachable for Write/Resolve (checked up front): logged
            logger.error("fast-lane completion does not fit: %s", exc, extra={"session": self.session_id})
            w.encode_completion(
                view,
                w.completion_offset(seq),
                w.Completion(opcode, seq, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], False, None, str(exc)),
            )
        name = _OP_NAMES.get(opcode, "FastLaneUnknown")
        self._observe.on_rpc(name, _status(done.status), time.perf_counter() - start)

    def _execute(self, req: w.Request) -> w.Completion:
        sid, op, seq = self.session_id, req.op_id, req.seq
        ok = grpc.StatusCode.OK.value[0]
        # The servicer's pre-core checks, mirrored in the same order: its unary wrapper's
        # identifiers, a keyed call's keys, then its conversion of the transfers.
        check_id_values((("session_id", sid), ("op_id", op)), self._limits)
        if req.opcode in w.KEYED:
            check_keys(req.keys, self._limits)
        transfers = transfers_in(req.transfers, self._limits)
        if req.opcode in (w.Opcode.WRITE, w.Opcode.RESOLVE):
            check_answer_fits(req, self._pools)
        if req.opcode is w.Opcode.WRITE:
            res = self._core.write(sid, op, transfers, allocate=bool(req.flags & w.FLAG_ALLOCATE))
            return w.Completion(
                req.opcode,
                seq,
                ok,
                res.ok,
                None,
                res.reason,
                transfers_out(res.transfers),
                acks_out(res.acks),
            )
        if req.opcode is w.Opcode.LOAD:
            layers: list[int] = []
            on_layer = self._on_layer(seq, layers) if req.flags & w.FLAG_LAYER_PROGRESS else None
            got = self._core.load(sid, op, transfers, on_layer=on_layer)
            return w.Completion(req.opcode, seq, ok, True, None, "", (), acks_out(got), tuple(layers))
        if req.opcode is w.Opcode.RESOLVE:
            res = self._core.resolve(sid, op, transfers)
            return w.Completion(req.opcode, seq, ok, res.ok, None, res.reason, transfers_out(res.transfers))
        if req.opcode is w.Opcode.PING:
            return w.Completion(req.opcode, seq, ok, True, None, "")
        if req.opcode in w.KEYED:
            return self._keyed_op(req, transfers)
        freed = self._core.release(sid, op, transfers)
        return w.Completion(req.opcode, seq, ok, True, None, "", value=freed)

    def _keyed_op(self, req: w.Request, transfers: list[PoolTransfer]) -> w.Completion:
        """GetPages / PutPages / Lookup with given keys (checked by :meth:`_execute`), as the
        servicer runs them."""
        sid, op, seq, ok = self.session_id, req.op_id, req.seq, grpc.StatusCode.OK.value[0]
        if req.opcode is w.Opcode.LOOKUP:  # read_request refused any transfers
            found = self._keyed.lookup(sid, req.keys)
            value = w.lookup_value(found.l2_hit_pages, found.total_hit_pages)
            return w.Completion(req.opcode, seq, ok, True, None, "", value=value)
        if req.opcode is w.Opcode.GET_PAGES:
            l3, waiting = bool(req.flags & w.FLAG_INCLUDE_L3), self._client_waits
            hit, got = self._keyed.get_pages(sid, op, req.keys, transfers, include_l3=l3, waiting=waiting)
            return w.Completion(req.opcode, seq, ok, True, None, "", (), acks_out(got), value=hit)
        put = self._keyed.put_pages(sid, op, req.keys, transfers)
        return w.Completion(
            req.opcode, seq, ok, put.ok, None, put.reason, (), acks_out(put.acks), value=put.stored_pages
        )

    def _on_layer(self, seq: int, layers: list[int]) -> Callable[[int], None]:
        doorbell = self._efds[2]

        def on_layer(layer: int) -> None:
            # Runs on the copy engine's thread right after the layer's copies completed. The
            # ring's views are looked up here, not captured: a failed copy's traceback may keep
            # this function alive, and a captured view would keep the ring from being unmapped.
            layer_seq, layer_ns = self._layer_seq, self._layer_ns
            if layer_seq is not None and layer_ns is not None and 0 <= layer < w.MAX_LAYERS:
                layer_ns[layer] = time.monotonic_ns()
                layer_seq[layer] = seq + 1  # 0 = never: a worker waits for seq + 1
                _ring_doorbell(doorbell)
            layers.append(layer)

        return on_layer


def _ring_doorbell(fd: int) -> None:
    """Wake the client. Its eventfd counter is its own to fill: a full one (EAGAIN) is
    readable already, so the client wakes either way."""
    try:  # noqa: SIM105 - once per completion: a try costs nothing, a suppress() object does
        os.eventfd_write(fd, 1)
    except BlockingIOError:
        pass


_OP_NAMES = {int(o): "FastLane" + "".join(p.capitalize() for p in o.name.split("_")) for o in w.Opcode}
# The gRPC method each opcode stands for: an error's message names it as gRPC's does.
_RPC_NAMES = {int(o): n for o, n in zip(w.Opcode, ("Write", "Load", "ResolveTransfers", "ReleaseTransfers",
              "FastLanePing", "GetPages", "PutPages", "Lookup"), strict=True)}  # fmt: skip


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _opcode_of(view: memoryview, seq: int) -> int:
    """The opcode a refused request record names if it is a known one (its label), else 0."""
    magic, _, opcode = w.REQUEST.unpack_from(view, w.request_offset(seq))[:3]
    return int(opcode) if magic == w.REQUEST_MAGIC and opcode in _OP_NAMES else 0


def _status(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


__all__ = ["Lane", "Refused"]
