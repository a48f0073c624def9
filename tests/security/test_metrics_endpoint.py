"""The /metrics endpoint against strangers who can reach its port (a pod's metrics port is
reachable from other pods; hicached/metrics_http.py).

Before, prometheus_client's server gave every connection a thread of its own with no
deadline: half-sent requests held a thread each for ever (1,500 of them, ended at once, each
rendered the exposition and stalled every gRPC call for seconds), one request head could hold
6.3 MiB, and any method or path was answered. A real daemon with metrics on 127.0.0.1:0.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hicached_client import HiCacheClient

from hicached.metrics import Metrics, serve_metrics
from hicached.metrics_http import HEAD_TIMEOUT_S, MAX_CONNECTIONS
from tests.support.daemon import Daemon
from tests.support.state import poll, proc_bytes

MIB = 1 << 20
PARTIAL = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # the blank line that ends the head never comes
# 100 header lines of ~64 KiB (just under http.server's limits), never ended: 6.3 MiB held per
# connection before.
HUGE_HEAD = b"GET /metrics HTTP/1.1\r\n" + b"".join(
    b"X-%03d: " % i + b"a" * 65520 + b"\r\n" for i in range(100)
)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _scrape(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    """Read (and drop) until the daemon closes ``sock``; False if it is still open after
    ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass  # reset: closed too
    return True


def test_a_request_head_held_open_is_dropped_at_its_deadline(metrics_served: tuple[Daemon, int]) -> None:
    """The deadline is for the whole head: a byte every half second does not extend it."""
    _, port = metrics_served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(PARTIAL)
        started = time.monotonic()
        sock.settimeout(0.5)
        closed = False
        while not closed and time.monotonic() - started < HEAD_TIMEOUT_S + 7:
            try:
                closed = sock.recv(4096) == b""
            except TimeoutError:
                sock.sendall(b"X")  # the stranger's trickle
            except OSError:
                closed = True
        held = time.monotonic() - started
    assert closed, f"a half-sent request was still open after {held:.1f} s"
    assert HEAD_TIMEOUT_S - 0.5 <= held <= HEAD_TIMEOUT_S + 3, held
    assert _scrape(port)[0] == 200


def test_connections_beyond_the_cap_take_no_thread_and_their_end_stalls_no_call(
    metrics_served: tuple[Daemon, int],
) -> None:
    daemon, port = metrics_served
    pid = daemon.process.pid
    before = _threads(pid)
    strangers = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(PARTIAL)
            strangers.append(sock)
        assert _threads(pid) <= before + 1, f"{_threads(pid) - before} threads for 300 idle connections"
        # Prometheus still gets in (a new connection replaces the oldest idle one).
        assert _scrape(port)[0] == 200
        # Each replaced connection was closed by the daemon: only the cap's worth stay open.
        open_now = [s for s in strangers if not _closed_by_server(s, 0.01)]
        assert len(open_now) <= MAX_CONNECTIONS, len(open_now)
        latencies: list[float] = []
        with HiCacheClient(daemon.target, timeout_s=30) as client:
            client.ping(b"warm")
            released = threading.Event()

            def release() -> None:
                for sock in strangers:  # every request ends at once (before, each was then rendered)
                    with contextlib.suppress(OSError):  # one the daemon replaced may be reset
                        sock.shutdown(socket.SHUT_WR)
                released.set()

            threading.Thread(target=release, daemon=True).start()
            end = time.monotonic() + 3.0
            while time.monotonic() < end or not released.is_set():
                t = time.perf_counter()
                assert client.ping(b"honest") == b"honest"
                latencies.append(time.perf_counter() - t)
        assert max(latencies) < 1.0, f"an honest ping took {max(latencies):.2f} s"
        assert _threads(pid) <= before + 1
    finally:
        for sock in strangers:
            sock.close()


def test_an_oversized_request_head_is_refused_and_holds_no_memory(metrics_served: tuple[Daemon, int]) -> None:
    daemon, port = metrics_served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
        sock.settimeout(10)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]

    pid = daemon.process.pid
    before = proc_bytes(pid, "VmRSS")
    strangers = []
    try:
        for _ in range(16):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.settimeout(10)
            with contextlib.suppress(OSError):  # the daemon refused the head and closed: the fix
                sock.sendall(HUGE_HEAD)
            strangers.append(sock)
        grown = (proc_bytes(pid, "VmRSS") - before) / MIB
        assert grown < 24, f"16 unfinished 6.4 MB request heads grew the daemon by {grown:.0f} MiB"
        still_open = sum(not _closed_by_server(s, 5.0) for s in strangers)
        assert still_open == 0, f"{still_open} of 16 oversized heads still held"
    finally:
        for sock in strangers:
            sock.close()


def test_scrapes_within_a_second_share_one_render(metrics_served: tuple[Daemon, int]) -> None:
    """A flood of scrapes costs one render a second: a scrape right after another gets the
    same bytes, even though a counter moved in between; the next second shows the move."""
    daemon, port = metrics_served
    with HiCacheClient(daemon.target, timeout_s=10) as client:
        shared = 0
        for _ in range(5):
            first = _scrape(port)[1]
            client.ping(b"moves hicached_rpcs_total")
            if _scrape(port)[1] == first:
                shared += 1
        assert shared >= 4, f"only {shared} of 5 scrapes right after another shared its render"
        before = _scrape(port)[1]
        client.ping(b"once more")
        poll(lambda: _scrape(port)[1], lambda body: body != before, 5.0, "a fresh render")


def test_only_get_and_head_of_the_metrics_path_are_served(metrics_served: tuple[Daemon, int]) -> None:
    _, port = metrics_served
    assert _scrape(port, "/metrics")[0] == 200
    assert _scrape(port, "/")[0] == 200
    status, body = _scrape(port, "/metrics", method="HEAD")
    assert (status, body) == (200, b"")
    assert _scrape(port, "/favicon.ico")[0] == 404
    assert _scrape(port, "/anything/at/all")[0] == 404
    status, body = _scrape(port, "/metrics", method="DELETE")
    assert status == 405
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"<script>alert(1)</script> /metrics HTTP/1.1\r\n\r\n")
        sock.settimeout(10)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 405 "), answer[:80]
    assert b"script" not in answer  # the method is not echoed


def _raw_answer(port: int, request: bytes) -> bytes:
    """Everything the endpoint sends for one raw request, up to its close."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        sock.settimeout(10)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("path", ["/metrics", "/nothing-here"])
def test_an_answer_to_head_has_no_body(metrics_served: tuple[Daemon, int], path: str) -> None:
    """Fails before the fix for a refusal: a HEAD of an unknown path was answered 404 with its
    body, which a client reading the next answer on the connection takes as its start (RFC 9110:
    a HEAD answer has none). The headers are those a GET gets."""
    _, port = metrics_served
    answer = _raw_answer(port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head, sep, body = answer.partition(b"\r\n\r\n")
    assert sep and body == b"", answer[-80:]
    assert head.startswith(b"HTTP/1.1 200 " if path == "/metrics" else b"HTTP/1.1 404 "), head[:40]
    assert b"Content-Length: " in head


def test_a_target_urllib_cannot_parse_is_a_bad_request_and_stalls_nothing(
    metrics_served: tuple[Daemon, int],
) -> None:
    """A reviewer's stranger sent ``GET //[x`` 50 times a second: urlsplit's ValueError escaped
    the connection, failed the server's step (an ERROR traceback each, outside the log's rate
    limit) and paused it 0.1 s; honest scrapes took 12.5 s."""
    _, port = metrics_served
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET //[x HTTP/1.1\r\n\r\n")
            sock.settimeout(10)
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:80]
    started = time.monotonic()
    assert _scrape(port)[0] == 200
    assert time.monotonic() - started < 5


# Waits for a line on stdin, connects, says so, and prints the first line of the answer.
CALLER = """
import socket, sys
sys.stdin.readline()
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"GET /metrics HTTP/1.1\\r\\n\\r\\n")
print("connected", flush=True)
s.settimeout(30)
print(s.recv(100).split(b"\\r\\n")[0].decode(), flush=True)
"""


def _cpu_s(stat_fd: int) -> float:
    """User + system CPU seconds of the thread whose ``/proc/self/task/<tid>/stat`` is open as
    ``stat_fd`` (re-read in place: out of descriptors, nothing can be opened)."""
    fields = os.pread(stat_fd, 4096, 0).decode().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_out_of_descriptors_the_listener_pauses_instead_of_spinning() -> None:
    """A caller waits in the backlog while the process has no descriptor left: the endpoint's
    thread must not retry accept() in a busy loop (it spun a core before), and answers the
    caller once descriptors are back. In this process, with its descriptor limit lowered."""
    endpoint = serve_metrics(Metrics(), "127.0.0.1", 0)
    stat_fd = os.open(f"/proc/self/task/{endpoint.thread.native_id}/stat", os.O_RDONLY)
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(endpoint.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert caller.stdin is not None and caller.stdout is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.dup(0))
        caller.stdin.write("go\n")
        caller.stdin.flush()
        assert caller.stdout.readline().strip() == "connected"
        # The window measured is five pauses of the listener, counted by the server itself:
        # spinning, it would take none, and the wait would fail.
        before, pauses = _cpu_s(stat_fd), endpoint.accept_pauses
        poll(lambda: endpoint.accept_pauses, lambda n: n >= pauses + 5, 10, "five accept pauses")
        spent = _cpu_s(stat_fd) - before
    finally:
        for fd in [*held, stat_fd]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert spent < 0.15, f"the endpoint's thread spent {spent:.2f} s of CPU over five pauses"
        assert caller.stdout.readline().strip() == "HTTP/1.1 200 OK"  # accepted once there are fds
    finally:
        caller.kill()
        caller.wait()
        endpoint.close()


def test_a_metrics_thread_that_cannot_start_leaves_nothing_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a pids limit the thread's start fails: before, the listener, selector and wake-up pair
    stayed open and the daemon ended with a traceback; now an OSError (the daemon's one-line
    start refusal) with every descriptor closed."""
    from prometheus_client import CollectorRegistry

    from hicached import metrics_http

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(OSError, match="cannot start the metrics thread"):
        metrics_http.start(CollectorRegistry(), "127.0.0.1", 0)
    monkeypatch.undo()
    assert set(os.listdir("/proc/self/fd")) <= before
