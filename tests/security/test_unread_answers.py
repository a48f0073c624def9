"""A peer that asks for large answers and never reads them: what it can make the daemon hold.

gRPC keeps an answer its peer does not read until the peer reads it or the connection is
dropped. A raw HTTP/2 client here (the ``h2`` package: the client library always reads)
sends GetBytes calls and never takes an answer (it grants no flow-control window and
acknowledges nothing; it only sees which calls end). The daemon counts those answers against
the peer that attached the session (``limits.max_unread_answer_bytes_per_peer``): past it,
that peer's calls are refused, another uid's are not, and the bytes come back once the
connection closes. CI runs as root, so the second uid exists.
"""

from __future__ import annotations

import socket
import struct
import time
import uuid
from collections.abc import Iterator

import grpc
import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest
from hicached_client import (
    HiCacheClient,
    HiCacheError,
    PageBytes,
    Session,
    TokenChain,
    WorkerIdentity,
    pool_spec,
)
from hicached_client._handoff import SESSION_SECRET_METADATA
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from tests.robustness.loop_support import PAGE_BYTES, attach_bytes
from tests.support.daemon import Daemon, start_daemon
from tests.support.state import proc_bytes

from .users import run_as_other

KEYS = 48  # one answer: 48 x 64 KiB = 3 MiB, over any HTTP/2 window the raw client opens
LIMIT = 8 << 20  # two such answers fit, a third does not
CALLS = 32  # what the raw client asks for: ~100 MiB of answers if all were built
MODEL = "m-unread"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon(
        "--set", f"limits.max_unread_answer_bytes_per_peer={LIMIT}",
        "--set", "server.socket_mode=0o666",
    )  # fmt: skip
    try:
        yield d
    finally:
        d.stop()


class NonReader:
    """An HTTP/2 connection to the daemon's socket that sends GetBytes calls and takes no answer."""

    def __init__(self, target: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self._sock.connect(target.removeprefix("unix:"))
        self._h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self._h2.initiate_connection()

    def get_bytes(self, session: Session, keys: list[str], calls: int) -> None:
        request = pb.GetBytesRequest(
            session_id=session.session_id, keys=tpb.KeySource(keys=tpb.PageKeys(keys=keys))
        )
        self.send(session, "GetBytes", request.SerializeToString(), calls)

    def send(self, session: Session, method: str, request: bytes, calls: int) -> None:
        for _ in range(calls):
            stream = self._h2.get_next_available_stream_id()
            self._h2.send_headers(
                stream,
                [
                    (":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
                    (":path", f"/hicached.v1.HiCacheService/{method}"),
                    ("content-type", "application/grpc"), ("te", "trailers"),
                    (SESSION_SECRET_METADATA, session.info.session_secret),
                ],
            )  # fmt: skip
            self._h2.send_data(stream, b"\0" + struct.pack(">I", len(request)) + request, end_stream=True)
        self._sock.sendall(self._h2.data_to_send())

    def wait_ended(self, calls: int, timeout_s: float) -> int:
        """Read what the daemon sent until ``calls`` streams ended (refused calls end with their
        status; a held answer cannot end, its window being closed) and return how many did.

        Frames are parsed and nothing is sent back: no window update, no settings ack, so no
        answer can be delivered."""
        ended, end = 0, time.monotonic() + timeout_s
        while ended < calls and time.monotonic() < end:
            self._sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            events = self._h2.receive_data(data)
            ended += sum(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) for e in events)
        return ended

    def close(self) -> None:
        self._sock.close()


OTHER = """
import sys
import numpy as np
from hicached_client import HiCacheClient, PageBytes
from tests.robustness.loop_support import PAGE_BYTES, attach_bytes
with HiCacheClient(sys.argv[1], timeout_s=30) as client:
    s = attach_bytes(client, "m-unread-other")
    keys = [f"other-{i}" for i in range(48)]
    data = np.full(PAGE_BYTES, 7, dtype=np.uint8).tobytes()
    s.put_bytes([PageBytes(k, "kv", data) for k in keys])
    got = s.get_bytes(keys)
    print(got.hit_pages, all(p.data == data for p in got.pages))
    s.detach()
"""


def test_a_peer_that_never_reads_its_answers_holds_at_most_its_limit_and_no_other_peer_waits(
    daemon: Daemon,
) -> None:
    """Fails before the fix: every call of the non-reader was answered and held, none refused
    (RSS grew by 308 MiB for 32 answers of 3 MiB; 22 MiB after), and the peer's next call was
    answered too."""
    with HiCacheClient(daemon.target, timeout_s=30) as client:
        session = attach_bytes(client, MODEL, lease_ms=60_000)  # no heartbeats: no wait below outlasts it
        keys = [uuid.uuid4().hex for _ in range(KEYS)]
        rng = np.random.default_rng(5)
        pages = [PageBytes(k, "kv", rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes()) for k in keys]
        assert session.put_bytes(pages).stored_pages == KEYS
        before = proc_bytes(daemon.process.pid, "VmRSS")
        stranger = NonReader(daemon.target)
        try:
            stranger.get_bytes(session, keys, CALLS)
            # Every call but the two held answers (6 MiB; a third is over the limit) is refused
            # before this peer calls again: else a call of its own could take the second slot.
            assert stranger.wait_ended(CALLS - 2, timeout_s=30) == CALLS - 2
            with pytest.raises(HiCacheError) as caught:
                session.get_bytes(keys)  # the peer holds 6 MiB unread: 3 MiB more are over 8
            refused = caught.value
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
            assert "limits.max_unread_answer_bytes_per_peer" in refused.message, refused.message
            assert "uid:0" in refused.message and len(refused.message) < 400
            assert refused.retry_after_ms is not None
            grown = proc_bytes(daemon.process.pid, "VmRSS") - before
            assert grown < 64 << 20, f"the daemon grew by {grown >> 20} MiB for answers nobody reads"
            other = run_as_other(OTHER, daemon.target)  # another uid: its own count, answered
            assert other.returncode == 0, other.stderr[-2000:]
            assert other.stdout.split() == [str(KEYS), "True"]
        finally:
            stranger.close()
        # The connection is gone, and with it the answers: the peer is answered again.
        end = time.monotonic() + 20
        got = None
        while got is None and time.monotonic() < end:
            try:
                got = session.get_bytes(keys)
            except HiCacheError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        assert got is not None and [p.data for p in got.pages] == [p.data for p in pages]
        session.detach()


def test_unread_lookup_answers_count_against_their_peer(daemon: Daemon) -> None:
    """Fails before the fix: a Lookup by tokens answers the keys it derived, and no such
    answer was counted, so a peer that never read them made the daemon hold every one (a
    review: 240 Lookups of 64 KiB each, RSS 248 MiB -> 2.9 GiB, none refused)."""
    one_token_pages = pool_spec(
        "kv", role="anchor", kind="mha", dtype="bfloat16", page_size=1, num_layers=1, num_heads=1,
        head_dim=8, k_buffers=(), v_buffers=(), host_bytes=64 * 32,
    )  # fmt: skip
    # Four requests of ~16 KB fit the raw client's first flow-control window; each answers
    # ~1 MiB of keys, which gRPC holds unsent for a client that grants no window. Counted
    # three times their wire size, two fit the 8 MiB limit: the others are refused.
    calls, chain = 4, [i % 100 for i in range(16_000)]
    with HiCacheClient(daemon.target, timeout_s=30) as client:
        # One call a session: a session's calls on the hash lane are bounded on their own.
        sessions = [
            client.attach(
                WorkerIdentity(f"lookup-{uuid.uuid4().hex[:8]}", 1, "m-unread-lookup"),
                [one_token_pages],
                lease_ms=60_000,
                heartbeat=False,
            )
            for _ in range(calls + 1)
        ]
        session = sessions[-1]
        keys = session.lookup(TokenChain(chain)).keys  # read: counted only while it is sent
        held = LIMIT // (3 * sum(len(k) + 3 for k in keys))  # as docs/limits.md counts them
        assert 0 < held < calls
        stranger = NonReader(daemon.target)
        try:
            for s in sessions[:calls]:
                request = pb.LookupRequest(
                    session_id=s.session_id, keys=tpb.KeySource(tokens=tpb.TokenChain(token_ids=chain))
                )
                stranger.send(s, "Lookup", request.SerializeToString(), 1)
            # The calls past the peer's limit are refused, so their streams end.
            assert stranger.wait_ended(calls - held, timeout_s=30) == calls - held
            with pytest.raises(HiCacheError) as caught:
                session.lookup(TokenChain(chain))
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value
            assert "limits.max_unread_answer_bytes_per_peer" in caught.value.message
        finally:
            stranger.close()
        end = time.monotonic() + 20  # the connection is gone, and with it the answers
        found = None
        while found is None and time.monotonic() < end:
            try:
                found = session.lookup(TokenChain(chain))
            except HiCacheError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        assert found is not None and len(found.keys) == len(chain)
        for s in sessions:
            s.detach()
