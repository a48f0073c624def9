"""The fd handoff server and its ticket registry, on real Unix sockets.

The server runs on its own event loop thread; clients are this process's
``hicached_client._handoff`` (or raw sockets, for malformed messages) and, for
the identity test, a client process running as a second uid.
"""

from __future__ import annotations

import asyncio
import os
import resource
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hicached_client import HiCacheError
from hicached_client._handoff import MAGIC, hand_over
from hicached_client.export import sealed_memfd

from hicached.server.handoff import (
    CONNECTION_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_UID,
    HandoffRegistry,
    HandoffServer,
    PeerCred,
    TicketRefused,
    handoff_path,
)
from tests.support.daemon import start_daemon

from .users import connections_as, other_user, run_as_other, unused_uids


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def inode(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


@dataclass
class Served:
    registry: HandoffRegistry
    path: Path
    loop: asyncio.AbstractEventLoop


@pytest.fixture
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # Short path (AF_UNIX limit); mode 0777 directory so the second uid can reach the socket.
    workdir = Path("/tmp") / f"hcho-{uuid.uuid4().hex[:8]}"
    workdir.mkdir()
    os.chmod(workdir, 0o755)
    registry = HandoffRegistry(ttl_s=30.0, max_pending=4, max_per_uid=2)
    server = HandoffServer(registry, workdir / "d.sock.fds", mode=0o666, max_fds=4)
    loop = asyncio.new_event_loop()
    started: Future[None] = Future()

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            server.start()
            started.set_result(None)

        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.result(timeout=10)
    try:
        yield Served(registry, server.path, loop)
    finally:
        done: Future[None] = Future()

        def stop() -> None:
            server.close()
            done.set_result(None)
            loop.stop()

        loop.call_soon_threadsafe(stop)
        done.result(timeout=10)
        thread.join(timeout=10)
        loop.close()
        registry.close()
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()


def test_handoff_gives_the_fds_and_the_kernel_credentials_to_one_attach(served: Served) -> None:
    fd = sealed_memfd("ho", 4096)
    try:
        ticket = hand_over(str(served.path), [fd], timeout_s=10)
        assert ticket is not None and len(ticket) == 32  # 128 random bits, hex
        taken = served.registry.take(ticket)
        assert taken is not None
        cred, fds = taken
        assert cred == PeerCred(uid=os.getuid(), gid=os.getgid(), pid=os.getpid())
        assert len(fds) == 1 and fds[0] != fd and inode(fds[0]) == inode(fd)  # the same memory, our own fd
        os.close(fds[0])
        assert served.registry.take(ticket) is None  # one use only
    finally:
        os.close(fd)


def test_too_many_fds_are_refused_and_none_is_kept(served: Served) -> None:
    fds = [sealed_memfd("many", 4096) for _ in range(6)]
    try:
        with pytest.raises(HiCacheError, match="more than 4 fds") as info:
            hand_over(str(served.path), fds, timeout_s=10)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert served.registry.pending == 0
    finally:
        for fd in fds:
            os.close(fd)


def test_a_malformed_message_is_refused_and_its_fds_closed(served: Served) -> None:
    fd = sealed_memfd("bad", 4096)
    before = len(os.listdir("/proc/self/fd"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(served.path))
        socket.send_fds(s, [b"not-the-magic"], [fd])
        reply = b""
        while chunk := s.recv(256):  # until EOF: the server has closed its end (and the fds) by then
            reply += chunk
    assert reply.startswith(b"error INVALID_ARGUMENT expected one message with payload " + MAGIC)
    assert served.registry.pending == 0
    assert len(os.listdir("/proc/self/fd")) == before  # the daemon side closed what it received
    os.close(fd)


def test_pending_tickets_are_bounded_per_uid(served: Served) -> None:
    tickets = [hand_over(str(served.path), [], timeout_s=10) for _ in range(2)]
    with pytest.raises(HiCacheError, match="unused handoff tickets") as info:
        hand_over(str(served.path), [], timeout_s=10)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for t in tickets:
        assert t is not None and served.registry.take(t) is not None
    assert hand_over(str(served.path), [], timeout_s=10) is not None  # room again


def test_expired_tickets_close_their_fds_exactly_once() -> None:
    now = [0.0]
    registry = HandoffRegistry(ttl_s=30.0, max_pending=8, max_per_uid=8, clock=lambda: now[0])
    fd = sealed_memfd("exp", 4096)
    dup = os.dup(fd)
    ticket = registry.put(PeerCred(1, 1, 1), [dup])
    now[0] = 29.0
    assert registry.expire() == 0 and fd_is_open(dup)
    now[0] = 30.0
    assert registry.expire() == 1
    assert not fd_is_open(dup)
    assert registry.take(ticket) is None
    assert registry.expire() == 0
    registry.close()
    os.close(fd)


def test_close_closes_every_pending_fd_and_refuses_new_handoffs() -> None:
    registry = HandoffRegistry()
    fd = sealed_memfd("close", 4096)
    dup = os.dup(fd)
    registry.put(PeerCred(1, 1, 1), [dup])
    registry.close()
    assert not fd_is_open(dup)
    dup2 = os.dup(fd)
    with pytest.raises(Exception, match="shutting down"):
        registry.put(PeerCred(1, 1, 1), [dup2])
    assert not fd_is_open(dup2)  # a refused handoff's fds are closed too
    os.close(fd)


def test_descriptors_held_in_one_uids_tickets_are_bounded() -> None:
    """Fails before the bound: a uid's 32 tickets of 64 fds each could hold 2,048 of the daemon's
    descriptors (a reviewer's 18 tickets held it at 1,023 of 1,024, and every other client's
    attach failed EMFILE)."""
    registry = HandoffRegistry(max_pending=8, max_per_uid=8, max_fds_per_uid=6)
    fd = sealed_memfd("bound", 4096)
    try:
        held = [os.dup(fd) for _ in range(4)]
        registry.put(PeerCred(1000, 1, 1), held)
        over = [os.dup(fd) for _ in range(3)]
        with pytest.raises(TicketRefused, match=r"server\.handoff_max_pending_fds_per_uid=6") as info:
            registry.put(PeerCred(1000, 1, 2), over)
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert not any(map(fd_is_open, over))  # a refused handoff's fds are closed
        assert registry.pending == 1 and all(map(fd_is_open, held))
        registry.put(PeerCred(1000, 1, 3), [os.dup(fd), os.dup(fd)])  # up to the bound
        registry.put(PeerCred(1001, 1, 4), [os.dup(fd) for _ in range(6)])  # another uid's own room
        assert registry.pending == 3
    finally:
        registry.close()
        os.close(fd)


def test_the_daemon_raises_its_descriptor_limit_and_bounds_a_uids_ticket_fds() -> None:
    """Fails before: a daemon started at a soft limit of 1,024 (a service manager's default)
    stayed there, below what its own bounds let clients hold. The fd bound is set through the
    command line as an operator would."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 1024)
    if hard <= low:
        pytest.fail(f"this test needs a hard descriptor limit above {low} (got {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # the child inherits it
    try:
        daemon = start_daemon("--set", "server.handoff_max_pending_fds_per_uid=2")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fds = [sealed_memfd("rl", 4096) for _ in range(3)]
    try:
        assert resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE) == (hard, hard)
        assert f"descriptor limit raised from {low} to {hard}" in daemon.log
        path = str(handoff_path(Path(daemon.target.removeprefix("unix://"))))
        with pytest.raises(HiCacheError, match=r"server\.handoff_max_pending_fds_per_uid=2") as info:
            hand_over(path, fds, timeout_s=10)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert hand_over(path, fds[:2], timeout_s=10) is not None
    finally:
        for fd in fds:
            os.close(fd)
        daemon.stop()


def hand_over_as_other(served: Served, timeout_s: float) -> tuple[PeerCred, list[int]]:
    """One memfd handed over by a process of the second uid; what the registry holds for it."""
    code = (
        "import sys\n"
        "from hicached_client._handoff import hand_over\n"
        "from hicached_client.export import sealed_memfd\n"
        "print(hand_over(sys.argv[1], [sealed_memfd('other', 4096)], timeout_s=float(sys.argv[2])))\n"
    )
    proc = run_as_other(code, str(served.path), str(timeout_s))
    assert proc.returncode == 0, proc.stderr[-2000:]
    taken = served.registry.take(proc.stdout.strip())
    assert taken is not None
    return taken


def test_the_ticket_carries_the_uid_of_the_process_that_sent_the_fds(served: Served) -> None:
    """SO_PEERCRED: a client running as a second uid is identified as that uid by the kernel,
    whatever it claims. (Skips only when not root; CI runs as root.)"""
    uid = other_user()
    cred, fds = hand_over_as_other(served, timeout_s=10)
    assert cred.uid == uid and cred.uid != os.getuid()
    assert len(fds) == 1
    os.close(fds[0])


def test_one_uids_idle_connections_do_not_lock_another_uid_out(served: Served) -> None:
    """Before: 64 connections in all (plus the kernel's backlog of 64), whoever held them, each
    kept for 5 s and simply opened again: one client connecting and sending nothing locked
    every other worker out of the handoff, and so out of attaching device buffers."""
    other_user()
    idle: list[socket.socket] = []
    try:
        for _ in range(200):  # connect and send nothing, as fast as the kernel takes them
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(served.path))
            except OSError:  # the backlog is full for this moment
                s.close()
                break
            idle.append(s)
        assert len(idle) > MAX_CONNECTIONS_PER_UID
        # Beyond its share, this uid's connections are answered at once and closed.
        last = idle[-1]
        last.setblocking(True)
        last.settimeout(10)
        assert last.recv(200).startswith(b"error RESOURCE_EXHAUSTED uid ")
        _, fds = hand_over_as_other(served, timeout_s=3)
        os.close(fds[0])
    finally:
        for s in idle:
            s.close()


def honest_handoff_is_prompt(served: Served) -> None:
    """Root hands one memfd over while others hold the slots: answered well within the 2 s
    timer that would free one, its ticket carrying root's uid."""
    fd = sealed_memfd("honest", 4096)
    try:
        start = time.monotonic()
        ticket = hand_over(str(served.path), [fd], timeout_s=10)
        elapsed = time.monotonic() - start
        assert elapsed < CONNECTION_TIMEOUT_S / 2, f"the handoff waited {elapsed:.2f} s for a slot"
        assert ticket is not None
        taken = served.registry.take(ticket)
        assert taken is not None and taken[0].uid == os.getuid()
        os.close(taken[1][0])
    finally:
        os.close(fd)


def test_uids_filling_every_handoff_slot_do_not_keep_another_uid_waiting(served: Served) -> None:
    """A reviewer's 2 uids x 32 idle connections held all 64 slots: an honest worker's handoff
    (a third uid) waited in the backlog for their 2 s timers, and again for every round of
    theirs. Now a full listener drops the oldest connection of the uid holding the most and
    admits the newcomer at once."""
    assert MAX_CONNECTIONS == 2 * MAX_CONNECTIONS_PER_UID
    first, (second,) = other_user(), unused_uids(1)
    idle: list[socket.socket] = []
    try:
        idle += connections_as(first, served.path, MAX_CONNECTIONS_PER_UID)
        idle += connections_as(second, served.path, MAX_CONNECTIONS_PER_UID)
        honest_handoff_is_prompt(served)
        # Dropped before the newcomer was admitted: readable now. Timers send nothing.
        readable, _, _ = select.select(idle, [], [], 0)
        dropped = [s for s in readable if s.recv(200).startswith(b"error RESOURCE_EXHAUSTED all fd handoff")]
        assert len(dropped) == 1, readable
        assert dropped[0] in (idle[0], idle[MAX_CONNECTIONS_PER_UID]), "the oldest of a top holder"
    finally:
        for s in idle:
            s.close()


def test_a_newcomer_that_would_hold_as_many_as_the_top_waits_for_a_slot(served: Served) -> None:
    """All taken (32 + 31 + one of root's), one more of the uid holding 31 displaces nobody (it
    would then hold as many as the top): it is answered once a slot frees, as before."""
    first, (second,) = other_user(), unused_uids(1)
    idle: list[socket.socket] = []
    try:
        idle += connections_as(first, served.path, MAX_CONNECTIONS_PER_UID)
        idle += connections_as(second, served.path, MAX_CONNECTIONS_PER_UID - 1)
        ours = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.append(ours)
        ours.connect(str(served.path))
        newcomer = connections_as(second, served.path, 1)[0]
        idle.append(newcomer)
        newcomer.sendall(MAGIC)
        ours.settimeout(CONNECTION_TIMEOUT_S / 2)
        ours.sendall(MAGIC)  # its answer frees a slot
        assert ours.recv(200).startswith(b"ok ")
        newcomer.settimeout(CONNECTION_TIMEOUT_S / 2)  # a slot freed: not its timer's drop
        assert newcomer.recv(200).startswith(b"ok ")
        readable, _, _ = select.select(idle[: 2 * MAX_CONNECTIONS_PER_UID - 1], [], [], 0)
        assert not [s for s in readable if s.recv(200).startswith(b"error")], "nobody was displaced"
    finally:
        for s in idle:
            s.close()


def test_a_parked_newcomer_does_not_stop_the_listener(served: Served) -> None:
    """Fails before: while one newcomer that could displace nobody waited for a slot, the
    listener accepted nobody, so three uids splitting the slots evenly (22/21/21) and getting
    one of their own parked held an honest handoff in the kernel's backlog until a timer freed a
    slot (~2 s, again every round). Now the listener goes on accepting: the honest handoff
    displaces as usual, and a second newcomer that can displace nobody is refused at once."""
    first = other_user()
    second, third = unused_uids(2)
    idle: list[socket.socket] = []
    try:
        idle += connections_as(first, served.path, 22)
        idle += connections_as(second, served.path, 21)
        idle += connections_as(third, served.path, 21)
        idle += connections_as(third, served.path, 1)  # would hold 22, as the top: waits
        honest_handoff_is_prompt(served)
        # The honest one served, the waiting one took its slot (22/21/21 again): one more of a
        # uid holding 21 waits, and another one behind it is refused at once.
        idle += connections_as(second, served.path, 1)
        extra = connections_as(first, served.path, 1)[0]
        idle.append(extra)
        extra.settimeout(CONNECTION_TIMEOUT_S / 2)
        assert extra.recv(200).startswith(b"error RESOURCE_EXHAUSTED all fd handoff slots are taken; retry")
    finally:
        for s in idle:
            s.close()


def test_uids_filling_every_ticket_do_not_lock_another_uid_out() -> None:
    """A reviewer's 8 uids, 32 tickets each, held all 256: an honest uid's attaches failed
    ("too many pending handoffs") 38 times in 38. Now a full registry drops the oldest ticket of
    the uid holding the most, never one of a uid that would then hold as many."""
    registry = HandoffRegistry(max_pending=4, max_per_uid=2, max_fds_per_uid=8)
    fd = sealed_memfd("fair", 4096)
    try:
        dropped = os.dup(fd)
        a = [registry.put(PeerCred(1000, 1, 0), [dropped]), registry.put(PeerCred(1000, 1, 1), [os.dup(fd)])]
        b = [registry.put(PeerCred(1001, 1, i), [os.dup(fd)]) for i in range(2)]
        honest = registry.put(PeerCred(2000, 1, 9), [os.dup(fd)])
        assert registry.take(a[0]) is None and not fd_is_open(dropped), "the oldest of a top holder"
        assert registry.pending == 4
        with pytest.raises(TicketRefused, match="too many pending handoffs"):
            registry.put(PeerCred(1000, 1, 5), [os.dup(fd)])  # 1000 would hold as many as 1001
        with pytest.raises(TicketRefused, match="handoff_max_pending_fds_per_uid"):
            registry.put(PeerCred(3000, 1, 9), [os.dup(fd) for _ in range(9)])  # over its own bound
        assert registry.pending == 4, "a handoff refused by its own bounds displaced nobody"
        later = registry.put(PeerCred(2001, 1, 10), [os.dup(fd)])  # displaces one of 1001's
        for ticket in (honest, later, a[1], *b[1:]):
            got = registry.take(ticket)
            assert got is not None, ticket
            os.close(got[1][0])
        assert registry.take(b[0]) is None
    finally:
        registry.close()
        os.close(fd)
