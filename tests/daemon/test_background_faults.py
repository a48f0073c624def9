"""Background tasks never die silently, and one failed shutdown step skips no other (review 28).

Each test injects one fault into a real daemon process (:mod:`tests.support.faults`) and
watches it from outside: the task goes on, the failure is in
``hicached_background_task_failures_total{task=...}``, and SIGTERM still ends cleanly.
"""

from __future__ import annotations

import contextlib
import socket

from tests.daemon.conftest import scrape, total
from tests.support.faults import log_lines, metrics_port, serve_patched, socket_files
from tests.support.state import poll

FAILURES = "hicached_background_task_failures_total"

# The fd-handoff ticket sweeper fails once, on its 3rd run; every run is logged ("SWEEP").
FAILING_SWEEP = """
import hicached.server.handoff as h
_calls = [0]
_expire = h.HandoffRegistry.expire
def expire(self):
    _calls[0] += 1
    print("SWEEP", _calls[0], flush=True)
    if _calls[0] == 3:
        raise RuntimeError("injected sweeper fault")
    return _expire(self)
h.HandoffRegistry.expire = expire
"""

# The lease reaper fails once, on its 3rd run; every run is logged ("REAP").
FAILING_REAPER = """
import hicached.core.service as cs
_calls = [0]
_expire = cs.HiCacheCore.expire
def expire(self, now=None):
    _calls[0] += 1
    print("REAP", _calls[0], flush=True)
    if _calls[0] == 3:
        raise RuntimeError("injected reaper fault")
    return _expire(self, now)
cs.HiCacheCore.expire = expire
"""

# The fast lane's first connection cannot be set up (an unexpected error in the acceptor).
FAILING_LANE = """
import hicached.server.fastlane as fl
_lane_init = fl.Lane.__init__
_first = [True]
def lane_init(self, *a, **k):
    if _first[0]:
        _first[0] = False
        raise RuntimeError("injected lane set-up fault")
    return _lane_init(self, *a, **k)
fl.Lane.__init__ = lane_init
"""

# The metrics endpoint's first accept fails (an unexpected error on its thread).
FAILING_METRICS_ACCEPT = """
import hicached.metrics_http as mh
_accept = mh.MetricsServer._accept
_first = [True]
def accept(self):
    if _first[0]:
        _first[0] = False
        raise RuntimeError("injected metrics accept fault")
    return _accept(self)
mh.MetricsServer._accept = accept
"""

# Closing the fast lanes at shutdown fails.
FAILING_LANE_CLOSE = """
import hicached.server.fastlane as fl
def close(self, timeout_s=5.0):
    raise RuntimeError("injected lane close fault")
fl.LaneServer.close = close
"""


def _lane_answers(path: str) -> bytes:
    """Connect to the lane socket and send a line that is no negotiation: a live acceptor
    hands it to a lane, which answers with an error line."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10.0)
        conn.connect(path)
        # A refusal comes at accept and closes the connection, maybe before this is sent.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.sendall(b"nonsense\n")
        return conn.recv(200)


def test_handoff_sweeper_keeps_running_after_a_failure_and_counts_it() -> None:
    """Fails before the fix: the sweeper was a bare call_later chain that ended at its first
    exception (3 runs, then none: expired tickets kept the worker's fds), and nothing counted it."""
    d = serve_patched(FAILING_SWEEP, "--metrics-port", "0", "--set", "server.handoff_ticket_ttl_s=0.4")
    try:
        port = metrics_port(d)
        # The 3rd run failed; runs go on after the backoff.
        poll(lambda: len(log_lines(d, "SWEEP")), lambda n: n >= 8, 30.0, "sweeps after the failure")
        assert total(scrape(port), FAILURES, task="handoff_sweep") == 1
        assert log_lines(d, "background task handoff_sweep failed")
    finally:
        assert d.stop() == 0


def test_lease_reaper_keeps_running_after_a_failure_and_counts_it() -> None:
    """The reaper is one of the supervised tasks (it had a loop of its own in the server): a
    failure is logged with its traceback, counted, and the runs go on after the backoff."""
    d = serve_patched(FAILING_REAPER, "--metrics-port", "0")
    try:
        port = metrics_port(d)
        poll(lambda: len(log_lines(d, "REAP")), lambda n: n >= 6, 30.0, "reaps after the failure")
        assert total(scrape(port), FAILURES, task="lease_reaper") == 1
        assert log_lines(d, "background task lease_reaper failed")
    finally:
        assert d.stop() == 0


def test_lane_acceptor_survives_a_failure_and_counts_it() -> None:
    """Fails before the fix: the acceptor thread died on the exception (every later lane client
    hung until its own timeout) and nothing counted it."""
    d = serve_patched(FAILING_LANE, "--metrics-port", "0")
    try:
        port = metrics_port(d)
        lane = f"{d.socket}.lane"
        with socket.socket(socket.AF_UNIX) as first:
            first.settimeout(10.0)
            first.connect(lane)
            assert first.recv(200) == b""  # set-up failed: closed
        assert _lane_answers(lane).startswith(b"error "), "the acceptor still accepts"
        assert total(scrape(port), FAILURES, task="lane_accept") == 1
        assert log_lines(d, "fast lane acceptor failed")
    finally:
        assert d.stop() == 0


def test_metrics_endpoint_survives_a_failure_and_counts_it() -> None:
    """Fails before the fix: prometheus_client's server had no such seam (its per-connection
    threads printed tracebacks to stderr, outside the log and its rate limit)."""
    d = serve_patched(FAILING_METRICS_ACCEPT, "--metrics-port", "0")
    try:
        port = metrics_port(d)
        # The first connection's accept fails; the thread logs, pauses and accepts it then.
        assert total(scrape(port), FAILURES, task="metrics_http") == 1
        assert log_lines(d, "metrics endpoint failed; serving again")
    finally:
        assert d.stop() == 0


def test_a_failed_shutdown_step_skips_no_other_and_exits_nonzero() -> None:
    """Fails before the fix: stop() ended at the lanes' exception (exit 1 from a traceback), so
    no L3 flush, no core close (no journals under warm restart) and the sockets stayed."""
    d = serve_patched(FAILING_LANE_CLOSE)
    try:
        code = d.terminate()
        assert code == 1, d.log[-3000:]
        assert log_lines(d, "shutdown step fast lanes failed")
        assert log_lines(d, "flushed pending L3 backups"), "the flush still ran"
        assert log_lines(d, "shutdown steps failed: fast lanes")
        assert "d.sock" not in socket_files(d.workdir) and "admin.sock" not in socket_files(d.workdir)
    finally:
        d.stop()
