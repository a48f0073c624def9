"""The fast lane's acceptor under resource exhaustion (review 28, findings 1 and 2).

Out of threads, a lane is refused with the protocol's RESOURCE_EXHAUSTED line and the
acceptor goes on (out of descriptors: tests/robustness/test_out_of_descriptors.py). It runs
a real daemon whose thread limit is lowered, which needs a
uid other than root (root is exempt from RLIMIT_NPROC): the daemon runs as ``nobody``, so
these tests run as root, as CI does.

At the limit of lanes in all (``server.fast_lane_max``), a closed lane's slot is free when
close() returns, a refusal at accept reaches a client whose send met a broken pipe, and a
newcomer displaces a negotiating connection of the uid holding the most, never an open lane.
"""

from __future__ import annotations

import ast
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Session, WorkerIdentity
from hicached_client.fastlane import FastLane

from hicached.server.lane import NEGOTIATE_TIMEOUT_S
from tests.security.users import NOBODY, as_nobody, connections_as, other_user, unused_uids
from tests.support.daemon import start_daemon
from tests.support.faults import log_lines, serve_patched, socket_files
from tests.support.kv import WorkerPools, unique_tag
from tests.support.state import poll


def _answer(conn: socket.socket) -> bytes:
    conn.settimeout(10.0)
    return conn.recv(300)


def _probe(path: str) -> bytes:
    """A lane connection sending a line that is no negotiation: a lane answers an error line."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10.0)
        conn.connect(path)
        # A refusal comes at accept and closes the connection, maybe before this is sent.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.sendall(b"nonsense\n")
        return _answer(conn)


# The daemon lowers its own thread limit on SIGUSR1 and restores it on SIGUSR2 (a process may
# lower its soft limit and raise it back up to the hard one; the test, even as root, may lack
# CAP_SYS_RESOURCE to prlimit a process of another uid).
NPROC_SWITCH = """
import resource, signal
_limits = resource.getrlimit(resource.RLIMIT_NPROC)
def _limit(signum, frame):
    resource.setrlimit(resource.RLIMIT_NPROC, (1, _limits[1]))  # no new thread for this uid
    print("NPROC LIMITED", flush=True)
def _restore(signum, frame):
    resource.setrlimit(resource.RLIMIT_NPROC, _limits)
    print("NPROC RESTORED", flush=True)
signal.signal(signal.SIGUSR1, _limit)
signal.signal(signal.SIGUSR2, _restore)
"""


def test_out_of_threads_refuses_the_lane_and_keeps_accepting() -> None:
    """Fails before the fix: thread.start() raised in the acceptor, which died (every later lane
    client hung), and SIGTERM then crashed joining the never-started thread (exit 1, no flush,
    sockets left)."""
    d = serve_patched(NPROC_SWITCH, "--set", "server.socket_mode=0o666", runner=as_nobody(), owner=NOBODY)
    lane = f"{d.socket}.lane"
    try:
        d.process.send_signal(signal.SIGUSR1)
        poll(lambda: log_lines(d, "NPROC LIMITED"), bool, 30.0, "the thread limit lowered")
        refused = _probe(lane)
        d.process.send_signal(signal.SIGUSR2)
        poll(lambda: log_lines(d, "NPROC RESTORED"), bool, 30.0, "the thread limit restored")
        assert refused.startswith(b"error RESOURCE_EXHAUSTED "), refused
        assert b"thread" in refused, refused
        assert _probe(lane).startswith(b"error "), "a lane is served again"
        assert log_lines(d, "cannot start its thread")
        assert d.terminate() == 0, d.log[-3000:]
        assert log_lines(d, "flushed pending L3 backups")
        assert socket_files(d.workdir) == []
    finally:
        d.stop()


def test_a_newcomer_out_of_threads_displaces_nobody() -> None:
    """Fails before the fix: all slots held by two uids' idle connections, a newcomer displaced
    the oldest of them and only then found no thread to start (likeliest exactly when the slots
    are full): both were refused. Now the displaced one is told only once the newcomer runs."""
    d = serve_patched(
        NPROC_SWITCH,
        "--set", "server.socket_mode=0o666",
        "--set", "server.fast_lane_max=4", "--set", "server.fast_lane_max_per_uid=4",
        runner=as_nobody(), owner=NOBODY,
    )  # fmt: skip
    lane = Path(f"{d.socket}.lane")
    idle: list[socket.socket] = []
    try:
        os.chmod(d.workdir, 0o711)  # nobody's 0700 scratch directory: the other uids may reach the socket
        first, (second,) = other_user(), unused_uids(1)
        idle += connections_as(first, lane, 2)
        idle += connections_as(second, lane, 2)
        d.process.send_signal(signal.SIGUSR1)
        poll(lambda: log_lines(d, "NPROC LIMITED"), bool, 30.0, "the thread limit lowered")
        refused = _probe(str(lane))
        d.process.send_signal(signal.SIGUSR2)
        poll(lambda: log_lines(d, "NPROC RESTORED"), bool, 30.0, "the thread limit restored")
        assert refused.startswith(b"error RESOURCE_EXHAUSTED the daemon cannot start a thread"), refused
        # Told before the newcomer's refusal was sent, had it been displaced: readable by now.
        readable, _, _ = select.select(idle, [], [], 0)
        told = [s.recv(200) for s in readable]
        assert not [t for t in told if b"holds the most" in t], told
        assert not log_lines(d, "dropped for uid")  # nor logged as dropped (it was, before)
    finally:
        for conn in idle:
            conn.close()
        d.stop()


@pytest.fixture(scope="module")
def one_lane() -> Iterator[Session]:
    """A session of a real daemon that allows one fast lane in all (``server.fast_lane_max=1``)."""
    d = start_daemon("--set", "server.fast_lane_max=1")
    pools = WorkerPools.create(unique_tag("fl-one"))
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            session = client.attach(WorkerIdentity("w-one", 1, "m-one"), pools.specs())
            yield session
            session.close()
    finally:
        pools.kv.close()
        pools.draft.close()
        d.stop()


def test_a_closed_lane_frees_its_slot_before_close_returns(one_lane: Session) -> None:
    """Fails before the fix: the daemon counted a lane against ``server.fast_lane_max`` until its
    thread had exited, after the client's close() returned, so closing and opening again at the
    limit was refused now and then."""
    for _ in range(50):
        FastLane.open(one_lane).close()


class _SendsAfterTheDaemonHangsUp(socket.socket):
    """A client socket whose ``connect`` returns only once the daemon has answered and closed
    its end: the negotiation line that follows then meets a broken pipe, every time."""

    def connect(self, address: object) -> None:  # type: ignore[override]
        super().connect(address)  # type: ignore[arg-type]
        hangup = select.poll()
        hangup.register(self.fileno(), select.POLLHUP)
        assert hangup.poll(10_000), "the daemon did not close a refused lane connection"


def test_a_refusal_at_accept_reaches_the_client_after_a_broken_pipe(
    one_lane: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon refuses a lane over ``server.fast_lane_max`` at accept and closes before the
    client sends: the client still reports the daemon's answer (RESOURCE_EXHAUSTED, naming the
    key), not a failed negotiation. Fails when the client lets the broken pipe end the call."""
    with contextlib.closing(FastLane.open(one_lane)):  # the one lane allowed
        monkeypatch.setattr(socket, "socket", _SendsAfterTheDaemonHangsUp)
        with pytest.raises(HiCacheError) as err:
            FastLane.open(one_lane)
        monkeypatch.undo()
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert "server.fast_lane_max" in err.value.message
    FastLane.open(one_lane).close()  # the refused connection took no slot


# Run as ``nobody``: four lane connections that never negotiate; prints what the last two were
# answered, then holds the first two until a line arrives on stdin.
_IDLE_CONNECTIONS = """
import socket, sys
held = []
for _ in range(4):
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(sys.argv[1])
    held.append(conn)
answers = []
for conn in held[2:]:
    conn.settimeout(10.0)
    answers.append(conn.recv(300).decode())
print(repr(answers), flush=True)
sys.stdin.readline()
"""


def test_idle_connections_of_one_uid_leave_lanes_for_the_others() -> None:
    """Fails before the fix: lanes were counted per uid only once negotiated, so another uid's
    connections that never send a line held every slot of ``server.fast_lane_max`` (and a
    thread each) for the negotiation timeout, again and again, and no other user got a lane.
    Now a uid's connections count from accept: its third is refused at once, naming the key."""
    d = start_daemon(
        "--set", "server.socket_mode=0o666",
        "--set", "server.fast_lane_max=4", "--set", "server.fast_lane_max_per_uid=2",
    )  # fmt: skip
    pools = WorkerPools.create(unique_tag("fl-idle"))
    attacker = None
    try:
        lane_socket = f"{d.socket}.lane"
        attacker = subprocess.Popen(
            [*as_nobody(), sys.executable, "-c", _IDLE_CONNECTIONS, lane_socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert attacker.stdout is not None and attacker.stdin is not None
        answers = attacker.stdout.readline()
        assert answers, attacker.communicate(timeout=30)
        for answer in ast.literal_eval(answers):
            assert answer.startswith(f"error RESOURCE_EXHAUSTED uid {NOBODY} already has 2 fast lanes"), (
                answer
            )
            assert "server.fast_lane_max_per_uid" in answer, answer
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            session = client.attach(WorkerIdentity("w-idle", 1, "m-idle"), pools.specs())
            with FastLane.open(session) as lane:  # two of the four slots are still free
                lane.ping()
            session.close()
    finally:
        if attacker is not None:
            attacker.communicate("\n", timeout=30)
        pools.kv.close()
        pools.draft.close()
        d.stop()


# Every eventfd the daemon asks for fails as if it were out of descriptors (only lanes use them).
NO_EVENTFD = """
import errno, os
def _no_eventfd(*args, **kwargs):
    raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
os.eventfd = _no_eventfd
"""


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_ring_the_daemon_cannot_create_is_refused_with_the_reason() -> None:
    """Fails before the fix: the OSError left the negotiation as a failure (a traceback in the
    daemon's log) and the client read a bare EOF. Now it reads RESOURCE_EXHAUSTED naming the
    error, nothing stays open, and gRPC goes on."""
    d = serve_patched(NO_EVENTFD)
    pools = WorkerPools.create(unique_tag("fl-ring"))
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            session = client.attach(WorkerIdentity("w-ring", 1, "m-ring"), pools.specs())
            with pytest.raises(HiCacheError) as first:
                FastLane.open(session)
            fds = _open_fds(d.process.pid)
            for _ in range(5):
                with pytest.raises(HiCacheError) as refused:
                    FastLane.open(session)
                assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
                assert "Too many open files" in refused.value.message, refused.value.message
            assert first.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED, first.value
            # A refused lane's connection closes just after its answer: wait for the five, and
            # nothing more may stay open (a memfd left by each refusal would be five more).
            poll(
                lambda: _open_fds(d.process.pid),
                lambda n: n <= fds,
                10.0,
                "the refused lanes' descriptors closed",
            )
            client.ping()
            session.close()
        assert not log_lines(d, "fast lane failed"), d.log[-3000:]
    finally:
        pools.kv.close()
        pools.draft.close()
        d.stop()


@pytest.fixture
def four_lanes() -> Iterator[tuple[Session, str]]:
    """A session (root's) of a daemon allowing four lanes in all, four per uid, its sockets open
    to every uid; and its lane socket."""
    d = start_daemon(
        "--set", "server.socket_mode=0o666",
        "--set", "server.fast_lane_max=4", "--set", "server.fast_lane_max_per_uid=4",
    )  # fmt: skip
    pools = WorkerPools.create(unique_tag("fl-four"))
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            session = client.attach(WorkerIdentity("w-four", 1, "m-four"), pools.specs())
            yield session, f"{d.socket}.lane"
            session.close()
    finally:
        pools.kv.close()
        pools.draft.close()
        d.stop()


def test_uids_filling_every_lane_slot_with_idle_connections_do_not_keep_another_uid_off(
    four_lanes: tuple[Session, str],
) -> None:
    """Fails before the fix: two uids' connections that never negotiate held every slot of
    ``server.fast_lane_max`` (each until its negotiation deadline, then again), and a third
    uid's lane was refused. Now the newcomer displaces the oldest negotiating connection of the
    uid holding the most, which reads why; the lane opens at once."""
    session, lane_socket = four_lanes
    first, (second,) = other_user(), unused_uids(1)
    idle: list[socket.socket] = []
    try:
        idle += connections_as(first, Path(lane_socket), 2)
        idle += connections_as(second, Path(lane_socket), 2)
        start = time.monotonic()
        with FastLane.open(session) as lane:
            lane.ping()
            elapsed = time.monotonic() - start
        assert elapsed < NEGOTIATE_TIMEOUT_S / 2, f"the lane waited {elapsed:.2f} s for a slot"
        # The acceptor tells the displaced connection once the newcomer's thread runs, which
        # may be after the newcomer's lane is open: wait for it (the others would be told
        # only by their 2 s deadline, with another line).
        readable, _, _ = select.select(idle, [], [], 10)
        told = [
            s for s in readable if s.recv(200).startswith(b"error RESOURCE_EXHAUSTED all fast lane slots")
        ]
        assert told == [idle[0]], (readable, told)  # the oldest of the first uid holding the most
    finally:
        for conn in idle:
            conn.close()
    # The displaced connection's slot was given back once, not again when its thread ended.
    _four_open_lanes_and_a_newcomer_refused(session, lane_socket)


def _four_open_lanes_and_a_newcomer_refused(session: Session, lane_socket: str) -> None:
    """Root opens four lanes (as soon as the slots are free: a lane's thread gives its slot
    back when it sees the client gone), then another uid's newcomer, holding none, is refused
    at accept (it uses gRPC), and every open lane still answers: an open lane is never
    displaced, and four lanes are all the daemon counts."""
    lanes: list[FastLane] = []

    def open_one() -> int:
        with contextlib.suppress(HiCacheError):
            lanes.append(FastLane.open(session))
        return len(lanes)

    try:
        poll(open_one, lambda n: n == 4, 30.0, "four open lanes")
        (newcomer,) = connections_as(NOBODY, Path(lane_socket), 1)
        with newcomer:
            answer = _answer(newcomer)
        assert answer.startswith(b"error RESOURCE_EXHAUSTED 4 fast lanes are open"), answer
        for lane in lanes:
            lane.ping()
    finally:
        for lane in lanes:
            lane.close()


def test_an_open_lane_is_never_displaced(four_lanes: tuple[Session, str]) -> None:
    _four_open_lanes_and_a_newcomer_refused(*four_lanes)
