"""A store that sends a page's object without ``Content-Length`` cannot make the daemon read it whole.

The ``s3`` backend checked an object's size only against its ``Content-Length``; a store (or
anyone who can answer for it) that streams a chunked body got every byte read into memory, for
every page of a batch. Here a real HTTP server on loopback answers for the bucket: ``HEAD`` of
the bucket succeeds, and ``GET`` of any object streams 64 MiB of chunked body, counting what it
managed to send before the reader hung up.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from hicached.errors import InvalidArgument
from hicached.l3 import StorageBackend, create_backend

STREAMED = 64 << 20
CHUNK = 64 << 10


@dataclass
class _Streams:
    sent: list[int] = field(default_factory=list)
    done: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    streams: _Streams

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:  # the bucket exists
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")  # no Content-Length
        self.end_headers()
        sent = 0
        chunk = b"%x\r\n" % CHUNK + b"A" * CHUNK + b"\r\n"
        try:
            while sent < STREAMED:
                self.wfile.write(chunk)
                sent += CHUNK
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the reader hung up
            self.close_connection = True
        finally:
            self.streams.sent.append(sent)
            self.streams.done.release()


@pytest.fixture
def hostile_store() -> Iterator[tuple[str, _Streams]]:
    streams = _Streams()
    handler = type("Handler", (_Handler,), {"streams": streams})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", streams
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _backend(endpoint: str, **extra: object) -> StorageBackend:
    return create_backend(
        "s3",
        {
            "bucket": "pages",
            "endpoint_url": endpoint,
            "access_key_id": "k",
            "secret_access_key": "s",
            "addressing_style": "path",
            "threads": 2,
            "max_attempts": 1,
            **extra,
        },
    )


def _sent(streams: _Streams, n: int) -> list[int]:
    for _ in range(n):
        assert streams.done.acquire(timeout=30), "the store's stream never ended"
    return sorted(streams.sent)


def test_a_chunked_object_is_read_no_further_than_its_destination(
    hostile_store: tuple[str, _Streams],
) -> None:
    """Before: ``get_into`` of two 4 KiB pages read both 64 MiB bodies whole (sent: 64 MiB each)."""
    endpoint, streams = hostile_store
    backend = _backend(endpoint)
    try:
        dests = [[memoryview(bytearray(4096))] for _ in range(2)]
        assert backend.get_into(["a", "b"], dests) == [False, False]
        assert all(bytes(d[0]) == bytes(4096) for d in dests)
    finally:
        backend.close()
    # What the sockets' buffers took after the reader hung up, not the whole body.
    assert all(sent < 16 << 20 for sent in _sent(streams, 2)), streams.sent


def test_a_page_of_unknown_size_is_read_no_further_than_max_object_bytes(
    hostile_store: tuple[str, _Streams],
) -> None:
    endpoint, streams = hostile_store
    backend = _backend(endpoint, max_object_bytes="1MiB")
    try:
        assert backend.get(["a"]) == [None]
    finally:
        backend.close()
    assert _sent(streams, 1)[0] < 16 << 20, streams.sent


def test_max_object_bytes_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="max_object_bytes"):
        _backend("http://127.0.0.1:9", max_object_bytes=0)
