"""The daemon's own listeners out of descriptors: they pause instead of spinning, log a streak
once, and serve the caller who waited once descriptors are back (review 28, finding 2).

A real daemon's descriptor limit is lowered from outside (prlimit) to its lowest free number,
so the next accept fails with EMFILE; the metrics listener's case is in
tests/security/test_metrics_endpoint.py.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
from pathlib import Path

import pytest

from tests.support.daemon import Daemon
from tests.support.faults import log_lines, serve_patched
from tests.support.state import poll

# The listener's socket suffix, and the words its log line starts with.
LISTENERS = {".lane": "fast lane accept failed", ".fds": "fd handoff accept failed"}


@pytest.mark.parametrize("suffix", sorted(LISTENERS))
def test_out_of_descriptors_pauses_the_listener_and_logs_once(suffix: str) -> None:
    """Fails before the fix: for the fast lane, accept() failed with EMFILE, the listener stayed
    readable and the acceptor retried at once (a core busy and ~40,000 warnings a second); the
    fd handoff paused but logged a warning at every pause (ten a second, for as long as it
    lasts)."""
    d = serve_patched("")
    needle = LISTENERS[suffix]
    try:
        limits = resource.prlimit(d.process.pid, resource.RLIMIT_NOFILE)
        try:
            waiting, spent, logged = _starved(d, f"{d.socket}{suffix}", needle, limits[1])
        finally:
            resource.prlimit(d.process.pid, resource.RLIMIT_NOFILE, limits)
        assert logged == 0, f"{logged} more lines in one second: logged once per streak, not per accept"
        # Paused 0.1 s between attempts: next to no CPU (a spinning acceptor used ~60 ticks a second).
        assert spent < 30, spent
        waiting.sendall(b"nonsense\n")
        waiting.settimeout(10.0)
        assert waiting.recv(300).startswith(b"error "), "the connection that waited is served"
        waiting.close()
    finally:
        assert d.stop() == 0


def _starved(d: Daemon, path: str, needle: str, hard: int) -> tuple[socket.socket, int, int]:
    """A connection the daemon failed to accept, out of descriptors, for a whole second; the
    daemon's CPU ticks and the lines ``needle`` it logged in that second (after the first).

    The descriptor limit is lowered to the lowest free descriptor number. A descriptor the
    daemon closes after that (a socket it closed late: seen under load in CI, and after the
    start's own readiness probe) frees a number below the limit, and an accept then succeeds:
    such a try (its descriptor table changed) is dropped and the limit lowered again.
    """
    pid = d.process.pid
    for _ in range(5):
        used = _descriptors(pid)
        lowest_free = next(n for n in range(len(used) + 1) if n not in used)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, hard))
        failures = len(log_lines(d, needle))
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(path)  # the kernel's backlog takes it; the daemon cannot accept it
        try:
            poll(
                lambda: len(log_lines(d, needle)),
                lambda n, before=failures: n > before,
                5.0,
                "the accept failure",
            )
        except AssertionError:
            conn.close()  # accepted after all: a descriptor was freed meanwhile
            continue
        before, lines, ticks = _descriptors(pid), len(log_lines(d, needle)), _cpu_ticks(pid)
        # While out of descriptors the caller waits unserved; this one-second wait for an
        # answer that must not come is also the window the listener is watched over.
        conn.settimeout(1.0)
        with pytest.raises(TimeoutError):
            conn.recv(1)
        spent, logged = _cpu_ticks(pid) - ticks, len(log_lines(d, needle)) - lines
        if _descriptors(pid) == before:
            return conn, spent, logged
        conn.close()
    pytest.fail(f"the daemon accepted every connection to {path}: its descriptors could not be exhausted")


def _descriptors(pid: int) -> dict[int, str]:
    """The daemon's open descriptors and what each is (a socket's inode tells two apart)."""
    found = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            found[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
    return found


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime + stime
