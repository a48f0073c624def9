"""The worker's side of the fast lane trusts neither who listens nor what the ring says.

* Who listens: before, ``FastLane.connect`` sent ``hicached-lane-v1 <session id> <secret>`` to
  whatever listened at ``<socket>.lane`` -- a stranger's uid in a squatted directory got the
  session's capability (the fd handoff already checked ``SO_PEERCRED``; the lane did not). It
  now refuses a listener that is not root, this uid or ``$HICACHED_DAEMON_UID`` and sends nothing.
* What the ring says: a completion claiming more acks or layers than fit its record raised
  ``struct.error`` / ``ValueError`` (not a HiCacheError, so the session did not fall back to
  gRPC and SGLang's threads saw it), and the lane stayed wedged: every later op re-read the
  same record and raised again. A malformed completion (or one of another seq) now closes the
  lane with UNAVAILABLE, which sends the session's ops over gRPC.
* What negotiation hands over: doorbells that are not eventfds (a pipe, a memfd) were used as
  such; the lane is now UNAVAILABLE and every received descriptor closed.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import shutil
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hicached_client import HiCacheError
from hicached_client import lane_wire as w
from hicached_client._lane_common import drain
from hicached_client.fastlane import FastLane

from tests.security.roles_helpers import scratch_dir
from tests.security.users import other_user, popen_as_other
from tests.support.state import poll

# A stranger's listener at the lane path: prints what the worker sent before it closed.
STRANGER = r"""
import socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1])
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
conn.settimeout(10)
got = b""
while chunk := conn.recv(512):
    got += chunk
print(repr(got), flush=True)
"""


@pytest.fixture
def run_dir() -> Iterator[Path]:
    base = scratch_dir()
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_session_secret_is_not_sent_to_a_strangers_lane(run_dir: Path) -> None:
    uid = other_user()
    squatted = run_dir / "run"
    squatted.mkdir()
    os.chown(squatted, uid, -1)
    stranger = popen_as_other(STRANGER, str(squatted / "hicached.sock.lane"))
    try:
        assert stranger.stdout is not None
        assert stranger.stdout.readline().strip() == "ready"
        with pytest.raises(HiCacheError) as info:
            FastLane.connect(str(squatted / "hicached.sock.lane"), "s-1", "the-session-secret", timeout_s=5)
        out, _ = stranger.communicate(timeout=30)
    finally:
        if stranger.poll() is None:
            stranger.kill()
            stranger.wait()
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED, info.value
    assert f"served by uid {uid}" in info.value.message and "HICACHED_DAEMON_UID" in info.value.message
    assert out.strip() == "b''", f"the stranger got {out.strip()}"


def hand_over_ring(
    conn: socket.socket, doorbells: list[int], *, v1_ring: bool = True
) -> tuple[mmap.mmap, memoryview]:
    """What a daemon answers a lane's negotiation with: a sealed ring (laid out when
    ``v1_ring``) and ``doorbells``; the ring stays mapped here."""
    fd = os.memfd_create("ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, w.RING_BYTES)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    ring = mmap.mmap(fd, w.RING_BYTES)
    view = memoryview(ring)
    if v1_ring:
        w.init_ring(view)
    socket.send_fds(conn, [b"ok lane\n"], [fd, *doorbells])
    os.close(fd)
    return ring, view


class HostileLane:
    """A lane listener (this process's uid) handing a real sealed ring; ``patch(view, offset)``
    spoils each completion after it is written."""

    def __init__(
        self,
        path: Path,
        patch: Callable[[memoryview, int], None],
        *,
        v1_ring: bool = True,
        doorbell: str = "eventfd",
    ) -> None:
        self.patch = patch
        self.v1_ring = v1_ring
        self.doorbell = doorbell  # "eventfd", or what a hostile daemon sends in its place
        self.others: list[int] = []  # the ends of those doorbells the hostile side keeps
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        conn.recv(512)
        efds = [self._bell() for _ in range(3)]
        ring, view = hand_over_ring(conn, efds, v1_ring=self.v1_ring)
        seq = 0
        if self.doorbell not in ("eventfd", "blocking eventfd"):  # the worker must refuse the lane
            self.stop.wait()
        while not self.stop.is_set():
            if not select.select([efds[0]], [], [], 0.1)[0]:
                continue
            os.eventfd_read(efds[0])
            tail = struct.unpack_from("<Q", view, w.SQ_TAIL)[0]
            while seq < tail:
                at = w.completion_offset(seq)
                w.encode_completion(view, at, w.Completion(int(w.Opcode.PING), seq, 0, True, None, ""))
                self.patch(view, at)
                seq += 1
                struct.pack_into("<Q", view, w.CQ_TAIL, seq)
                os.eventfd_write(efds[1], 1)
        conn.close()
        view.release()
        ring.close()
        for e in (*efds, *self.others):
            os.close(e)

    def _bell(self) -> int:
        if self.doorbell == "pipe":
            read, write = os.pipe()
            self.others.append(write)
            return read
        if self.doorbell == "memfd":  # always readable: the worker's poll would spin
            return os.memfd_create("bell")
        if self.doorbell == "blocking eventfd":
            return os.eventfd(0)
        return os.eventfd(0, os.EFD_NONBLOCK)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close()


# Byte offsets of COMPLETION fields (``<IHHQIIiIIIQI256s``).
OFFSET = {"seq": 8, "nacks": 32, "nlayers": 36, "value": 40, "message length": 48}


@pytest.mark.parametrize(
    ("name", "value", "fmt"),
    [("nacks", 0xFFFFFFFF, "<I"), ("nlayers", 0xFFFFFFFF, "<I"), ("seq", 7, "<Q"),
     ("message length", 0xFFFFFFFF, "<I")],
)  # fmt: skip
def test_a_malformed_completion_closes_the_lane(run_dir: Path, name: str, value: int, fmt: str) -> None:
    path = run_dir / "hicached.sock.lane"
    hostile = HostileLane(path, lambda view, at: struct.pack_into(fmt, view, at + OFFSET[name], value))
    try:
        lane = FastLane.connect(str(path), "s-1", "secret", timeout_s=5)
        for _ in range(2):  # the first closes the lane; the next says it is closed
            with pytest.raises(HiCacheError) as info:
                lane.ping(timeout_s=5)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        assert lane.closed
    finally:
        hostile.close()


def _eventfds() -> int:
    """Eventfds open in this process (the listing's own fd is gone when it is read: skipped)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    return count


def test_a_ring_of_another_layout_is_no_lane(run_dir: Path) -> None:
    """A ring whose header is not v1's raised lane_wire.RecordError from ``connect`` (not a
    HiCacheError: the session did not fall back to gRPC, SGLang's thread saw it) and left the
    three doorbells and the ring's mapping open."""
    before = _eventfds()
    err = _lane_refused(run_dir, v1_ring=False)
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert _eventfds() == before, "the lane's doorbells were left open"


def _lane_refused(run_dir: Path, **hostile: Any) -> HiCacheError:
    """The error of a lane connect to a :class:`HostileLane` made with ``hostile`` that serves nothing."""
    path = run_dir / "hicached.sock.lane"
    lane = HostileLane(path, lambda view, at: None, **hostile)
    try:
        with pytest.raises(HiCacheError) as info:
            FastLane.connect(str(path), "s-1", "secret", timeout_s=5)
    finally:
        lane.close()
    return info.value


def test_a_lane_lookup_counting_more_hits_than_keys_is_an_error(run_dir: Path) -> None:
    """A LOOKUP completion of 5 leading hits for one key was taken as sent (the adapter's
    ``batch_exists`` answered SGLang more pages than it asked about); it is INTERNAL now."""
    path = run_dir / "hicached.sock.lane"
    five = (5 << w.LOOKUP_SHIFT) | 5
    hostile = HostileLane(path, lambda view, at: struct.pack_into("<Q", view, at + OFFSET["value"], five))
    try:
        lane = FastLane.connect(str(path), "s-1", "secret", timeout_s=5)
        with pytest.raises(HiCacheError) as info:
            lane.lookup(["k0"], timeout_s=5)
        assert not lane.closed  # a well-formed record: the lane goes on
    finally:
        hostile.close()
    lane.close()
    assert info.value.code == grpc.StatusCode.INTERNAL, info.value
    assert "a hit run of 5 pages for 1 keys" in info.value.message


def _open_fds() -> dict[str, str]:
    """Open fds of this process and what each is (the listing's own fd, gone when read: skipped)."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return fds


@pytest.mark.parametrize("doorbell", ["pipe", "memfd"])
def test_doorbells_that_are_not_eventfds_are_no_lane(run_dir: Path, doorbell: str) -> None:
    """Fails before: any three descriptors were taken as the lane's doorbells. A memfd in their
    place is always readable (the worker's wait spins on a core), a pipe never rings (every op
    waits out its deadline). Now the lane is UNAVAILABLE (the session stays on gRPC) and every
    descriptor received is closed."""
    before = _open_fds()
    err = _lane_refused(run_dir, doorbell=doorbell)
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert "not an eventfd" in err.message
    leaked = {fd: link for fd, link in _open_fds().items() if before.get(fd) != link}
    assert not leaked, f"received descriptors left open: {leaked}"


def test_a_blocking_doorbell_does_not_block_the_worker(run_dir: Path) -> None:
    """Fails before: an eventfd without O_NONBLOCK passed the checks, and resetting it with
    nothing to read (the asyncio lane does so on its event loop) blocked for good (the review's
    repro: still blocked after 2 s). Now the worker makes every doorbell non-blocking."""
    path = run_dir / "hicached.sock.lane"
    hostile = HostileLane(path, lambda view, at: None, doorbell="blocking eventfd")
    try:
        lane = FastLane.connect(str(path), "s-1", "secret", timeout_s=5)
        lane.ping(timeout_s=5)
        done, _ = lane.wake_fds
        reset = threading.Thread(target=drain, args=(done,), daemon=True)
        reset.start()
        reset.join(5)
        assert not reset.is_alive(), "resetting a doorbell with nothing to read blocked"
        lane.close()
    finally:
        hostile.close()


# Syscall numbers of a thread blocked in poll(2)/ppoll(2): x86_64 poll, x86_64 ppoll, aarch64 ppoll.
_POLLING = {"7", "271", "73"}


def _in_poll(tid: int) -> bool:
    return Path(f"/proc/self/task/{tid}/syscall").read_text().split(" ", 1)[0] in _POLLING


def test_a_completion_written_before_the_daemon_hangs_up_is_read(run_dir: Path) -> None:
    """Fails before (a review of the lane's client, found by reading): a worker asleep on its
    lane that woke to the daemon's EOF closed the lane without reading the completion the daemon
    had written before hanging up (the async lane read it): the op failed UNAVAILABLE. Here the
    daemon side answers while the worker sleeps in poll, rings no doorbell, and hangs up."""
    path = run_dir / "hicached.sock.lane"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    worker = threading.get_native_id()
    failures: list[BaseException] = []

    def daemon_side() -> None:
        try:
            conn, _ = sock.accept()
            conn.recv(512)
            efds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(3)]
            ring, view = hand_over_ring(conn, efds)
            assert select.select([efds[0]], [], [], 30)[0], "no submission"
            poll(lambda: _in_poll(worker), bool, 30.0, "the worker asleep on its lane")
            w.encode_completion(
                view, w.completion_offset(0), w.Completion(int(w.Opcode.PING), 0, 0, True, None, "")
            )
            struct.pack_into("<Q", view, w.CQ_TAIL, 1)
            conn.close()  # no doorbell: the EOF alone wakes the worker
            view.release()
            ring.close()
            for e in efds:
                os.close(e)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=daemon_side, daemon=True)
    thread.start()
    try:
        lane = FastLane.connect(str(path), "s-1", "secret", timeout_s=5)
        lane.spin_us = 0
        lane.ping(timeout_s=30)  # before: UNAVAILABLE, the lane closed by the daemon
        thread.join(30)
        assert not failures, failures
        with pytest.raises(HiCacheError) as info:  # the next op finds the lane gone
            lane.ping(timeout_s=30)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        thread.join(30)
        sock.close()
