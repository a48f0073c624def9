"""A caller without the token is refused at its headers: its request body is never read.

The token check refused a unary call only once gRPC had read the whole message and parsed it
(the refusing handler kept the method's request deserializer), so a stranger on the TCP port
had up to ``server.max_message_bytes`` per stream read, parsed on the event loop and held; a
body it never finished was held as long as its connection stayed open (reviewer: 64 streams
of 8 MiB - 1 byte, RSS 251 -> 766 MiB, no stream ever answered). Here a raw HTTP/2 client
sends the headers of a call without a token and the start of a message declared 8 MiB, and
never sends the rest.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest

from tests.support.daemon import Daemon, start_daemon

TOKEN = "unread-body-token"
UNAUTHENTICATED = "16"


@pytest.fixture(scope="module")
def tcp_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    token_file = Path(tmp_path_factory.mktemp("token")) / "token"
    token_file.write_text(TOKEN + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    daemon: Daemon = start_daemon(
        "--listen", f"127.0.0.1:{port}", "--set", f"server.auth_token_file={token_file}"
    )
    try:
        yield port
    finally:
        daemon.stop()


def _status_of_unfinished_call(port: int, path: str, timeout_s: float) -> str | None:
    """Send ``path``'s headers with no token and 48 KiB of a message declared 8 MiB (no end of
    stream); the grpc-status the daemon answers with within ``timeout_s``, or None."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(
            stream,
            [
                (":method", "POST"), (":scheme", "http"), (":authority", "localhost"), (":path", path),
                ("content-type", "application/grpc"), ("te", "trailers"),
            ],
        )  # fmt: skip
        conn.send_data(stream, b"\0" + struct.pack(">I", 8 << 20))
        for _ in range(3):  # 48 KiB: within the stream's first window, frames of at most 16 KiB
            conn.send_data(stream, b"\0" * (16 << 10))
        sock.sendall(conn.data_to_send())
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return None
            if not data:
                return None
            for event in conn.receive_data(data):
                headers = getattr(event, "headers", None)
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)) and headers:
                    found = dict((bytes(k), bytes(v)) for k, v in headers).get(b"grpc-status")
                    if found is not None:
                        return found.decode()
            sock.sendall(conn.data_to_send())  # settings and ping acks
    return None


@pytest.mark.parametrize(
    "path",
    [
        "/hicached.v1.HiCacheService/Lookup",
        "/hicached.v1.HiCacheService/Load",
        "/hicached.v1.HiCacheService/NoSuchMethod",  # before: UNIMPLEMENTED, telling what is served
    ],
    ids=["unary-answer", "streamed-answer", "unknown-method"],
)
def test_a_call_without_the_token_is_refused_before_its_body_arrives(tcp_port: int, path: str) -> None:
    """Before: no answer (the daemon waited for the other 8 MiB of the message)."""
    assert _status_of_unfinished_call(tcp_port, path, timeout_s=10) == UNAUTHENTICATED
