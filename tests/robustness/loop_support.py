"""Shared by the tests/robustness/test_loop_*.py modules: byte-only sessions (no device
memory), raw gRPC calls with arbitrary bytes, the daemon's peak RSS, and a fake Redis
that answers until told to hang (then accepts, reads and never answers)."""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import uuid
from collections.abc import Iterator

import grpc
from hicached_client import HiCacheClient, Session, WorkerIdentity, pool_spec
from hicached_client.v1 import types_pb2 as tpb

from tests.support.daemon import Daemon, start_daemon

PAGE, LAYERS, HEADS, DIM = 16, 2, 8, 64
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * DIM * 2  # K and V, bf16: 64 KiB
HOST_PAGES = 64


def byte_spec(pages: int = HOST_PAGES) -> tpb.PoolSpec:
    return pool_spec(
        "kv", role="anchor", kind="mha", dtype="bfloat16", page_size=PAGE, num_layers=LAYERS,
        num_heads=HEADS, head_dim=DIM, host_layout="layer_first", k_buffers=(), v_buffers=(),
        host_bytes=pages * PAGE_BYTES,
    )  # fmt: skip


def attach_bytes(client: HiCacheClient, model: str, *, lease_ms: int = 0, instance: str = "") -> Session:
    identity = WorkerIdentity(instance or f"loop-{uuid.uuid4().hex[:8]}", 1, model)
    return client.attach(identity, [byte_spec()], lease_ms=lease_ms, heartbeat=False)


def raw_unary(target: str, method: str, payload: bytes, timeout_s: float = 10.0) -> grpc.RpcError:
    """Send ``payload`` as the request bytes of ``method``; the error it gets."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(payload, timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc
    raise AssertionError(f"{method} accepted {payload!r}")


class FakeRedis:
    """A RESP server on loopback: answers the handshake, PING, INFO, DBSIZE and EXISTS (an
    empty store, or with ``present`` one that holds every key) until :meth:`hang`; from then
    on it accepts and reads but does not answer (the ``only`` commands, or all) until
    :meth:`resume`.
    :meth:`close` drops every connection (so the daemon's blocked calls fail at once)."""

    def __init__(self, *, present: bool = False) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._present = present
        self._hung = threading.Event()
        self._hung_commands: frozenset[bytes] | None = None
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._unanswered = threading.Condition(self._lock)
        self.unanswered = 0  # commands read while hung
        self._held: list[tuple[socket.socket, list[bytes]]] = []  # answered by resume()
        self.seen: collections.Counter[bytes] = collections.Counter()  # commands read, by name
        threading.Thread(target=self._accept, daemon=True).start()

    def daemon_args(self) -> tuple[str, ...]:
        """``hicached serve`` arguments of a daemon whose L3 is this fake (a hung call waits
        up to 60 s for an answer, longer than any test waits for it)."""
        return (
            "--l3", "redis",
            "--set", "l3.redis.host=127.0.0.1",
            "--set", f"l3.redis.port={self.port}",
            "--set", "l3.redis.socket_timeout_s=60",
        )  # fmt: skip

    def hang(self, only: frozenset[bytes] | None = None) -> None:
        """Stop answering: the commands named in ``only`` (upper case), or every one."""
        self._hung_commands = only
        self._hung.set()

    def resume(self) -> None:
        """Answer again: the commands held since :meth:`hang` first, in order."""
        with self._lock:
            self._hung.clear()
            for conn, words in self._held:
                with contextlib.suppress(OSError):
                    conn.sendall(_reply(words, present=self._present))
            self._held = []

    def wait_unanswered(self, n: int, timeout_s: float) -> None:
        """Block until ``n`` commands wait for an answer (AssertionError after ``timeout_s``)."""
        with self._unanswered:
            if not self._unanswered.wait_for(lambda: self.unanswered >= n, timeout=timeout_s):
                raise AssertionError(f"only {self.unanswered} of {n} L3 calls reached the fake Redis")

    def wait_seen(self, command: bytes, n: int, timeout_s: float) -> None:
        """Block until ``n`` ``command`` commands were read (AssertionError after ``timeout_s``)."""
        with self._unanswered:
            if not self._unanswered.wait_for(lambda: self.seen[command] >= n, timeout=timeout_s):
                raise AssertionError(f"only {self.seen[command]} of {n} {command!r} reached the fake Redis")

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone would not)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while (command := _parse(buf)) is not None:
                    words, buf = command
                    with self._unanswered:
                        self.seen[words[0].upper() if words else b""] += 1
                        self._unanswered.notify_all()
                        if self._hung.is_set() and (  # read, answered only by resume()
                            self._hung_commands is None
                            or (words[0].upper() if words else b"") in self._hung_commands
                        ):
                            self.unanswered += 1
                            self._held.append((conn, words))
                            self._unanswered.notify_all()
                            continue
                        # Under the lock: a resume() sends the held answers first, in order.
                        conn.sendall(_reply(words, present=self._present))


def _parse(buf: bytes) -> tuple[list[bytes], bytes] | None:
    """One RESP array of bulk strings from ``buf``: (words, rest), or None if incomplete."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None
    head, rest = buf.split(b"\r\n", 1)
    words = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line[1:])
        if len(rest) < size + 2:
            return None
        words.append(rest[:size])
        rest = rest[size + 2 :]
    return words, rest


def _reply(words: list[bytes], *, present: bool) -> bytes:
    name = words[0].upper() if words else b""
    if name == b"PING":
        return b"+PONG\r\n"
    if name == b"HELLO":  # RESP3 handshake: a map that names the protocol
        return b"%1\r\n$5\r\nproto\r\n:3\r\n"
    if name in (b"CLIENT", b"SELECT", b"AUTH"):
        return b"+OK\r\n"
    if name == b"INFO":
        body = b"# Memory\r\nused_memory:0\r\nmaxmemory:0\r\n"
        return b"$%d\r\n%s\r\n" % (len(body), body)
    if name == b"EXISTS":
        return b":1\r\n" if present else b":0\r\n"
    if name == b"SCAN":  # an empty database: cursor 0, no keys
        return b"*2\r\n$1\r\n0\r\n*0\r\n"
    return b"-ERR unknown command\r\n"


@contextlib.contextmanager
def fake_l3_daemon(*args: str, present: bool = False) -> Iterator[tuple[Daemon, FakeRedis]]:
    """A daemon (``hicached serve`` arguments ``args`` added) whose L3 is a :class:`FakeRedis`;
    the fake is closed first at the end, so the daemon's blocked L3 calls fail and it stops
    promptly."""
    fake = FakeRedis(present=present)
    d = start_daemon(*fake.daemon_args(), *args)
    try:
        yield d, fake
    finally:
        fake.close()
        d.stop()
