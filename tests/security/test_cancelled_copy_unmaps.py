"""A session whose copy is cancelled in flight leaves nothing of the worker's memory mapped.

A worker hands its device buffers over as memfds, which the daemon maps for the session's
life. When the session ended (Detach, a lease running out) while a Write or Load was copying,
the cancelled copy's exception kept the buffers mapped after the session was gone: its
traceback held the copy's frames (one holds the session through a closure) in a reference
cycle -- the copy engine's own (frame -> job -> future -> exception) and gRPC's (an aborted
call keeps its AbortError, whose context is the daemon's error) -- that only the cyclic
garbage collector frees. A client looping attach, copy, detach kept every earlier session's
buffers in the daemon's address space, beyond ``limits.max_buffer_bytes_per_peer`` (which
counts live sessions only).

The daemon here is real, with two changes made before it starts: its cyclic collector is
off, so what is still mapped is what reference counting did not release (the collector runs
whenever allocations say so, which a test cannot tell from a fix), and a copy pauses
before its first pages while the file ``pause-copies`` exists in the daemon's directory,
until its session's end stops it: the copy is in flight when the session ends, every time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Session, WorkerIdentity

from hicached.testing.daemon import Daemon
from tests.support.faults import log_lines, serve_patched
from tests.support.kv import WorkerPools, host_pages_of, transfers, unique_tag
from tests.support.state import memfd_mappings, poll

WAIT_S = 30.0
ORPHANED_TASK = "Task exception was never retrieved"
PENDING_TASK = "Task was destroyed but it is pending"
PAGES = list(range(256))

PATCH = """
import collections, gc, os, threading
gc.disable()
from hicached.transfer import engine

_run = engine.CopyEngine._run
_check_stop = engine.CopyEngine._check_stop
_cancel_owner = engine.CopyEngine.cancel_owner
_copy = threading.local()  # the checks of the copy this thread runs (holding no job)
_ended = collections.defaultdict(threading.Event)  # by owner: set once cancel_owner returned

def _counted_run(self, job, ctx):
    _copy.checks = 0
    return _run(self, job, ctx)

def _paused_check(job):
    # A job's first check is before its ready fence; the second, before its first pages.
    _copy.checks += 1
    if _copy.checks == 2 and os.path.exists("pause-copies"):
        print("copy paused", flush=True)
        _ended[job.owner].wait(60)  # the session's end stops its running copies first
    _check_stop(job)

def _cancel(self, owner):
    try:
        return _cancel_owner(self, owner)
    finally:
        _ended[owner].set()

engine.CopyEngine._run = _counted_run
engine.CopyEngine._check_stop = staticmethod(_paused_check)
engine.CopyEngine.cancel_owner = _cancel
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = serve_patched(PATCH)
    try:
        yield d
    finally:
        d.stop()


@contextmanager
def copies_paused(daemon: Daemon) -> Iterator[Callable[[], None]]:
    """Inside, each copy pauses before its first pages until its session ends; yields a
    function that waits until one copy more than before has paused."""
    flag = daemon.workdir / "pause-copies"
    seen = len(log_lines(daemon, "copy paused"))
    flag.touch()
    try:
        yield lambda: poll(
            lambda: len(log_lines(daemon, "copy paused")), lambda n: n > seen, WAIT_S, "a copy pausing"
        )
    finally:
        flag.unlink()


def in_thread(call: Callable[[], object]) -> Callable[[], BaseException | None]:
    """Start ``call`` on a thread; returns a function that joins it and returns what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> BaseException | None:
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the call never returned"
        return raised[0] if raised else None

    return join


def _attach(client: HiCacheClient, pools: WorkerPools, lease_ms: int = 0) -> Session:
    return client.attach(
        WorkerIdentity(unique_tag("unmap"), 1, "m-unmap"), pools.specs(), lease_ms=lease_ms, heartbeat=False
    )


def _unmapped(pid: int, tag: str) -> None:
    """Wait until no memfd of ``tag`` is mapped in the daemon. The answer to the cancelled call
    can reach the client before the thread that ran the copy has dropped its last reference
    (seen once in CI, under load); the collector is off, so the wait cannot be what frees them."""
    poll(lambda: memfd_mappings(pid, tag), lambda m: m == [], WAIT_S, "the buffers unmapped")


def _cancelled(error: BaseException | None) -> None:
    assert isinstance(error, HiCacheError), f"the copy was not cancelled: {error!r}"
    assert error.code == grpc.StatusCode.CANCELLED, error


def test_a_write_cancelled_by_detach_leaves_no_buffer_mapped(
    daemon: Daemon, worker_pools: list[WorkerPools]
) -> None:
    tag = unique_tag("unmap-w")
    pools = WorkerPools.create(tag)
    worker_pools.append(pools)
    pid = daemon.process.pid
    with HiCacheClient(daemon.target, timeout_s=WAIT_S) as client:
        session = _attach(client, pools)
        assert memfd_mappings(pid, tag), "the attach mapped no memfd"
        with copies_paused(daemon) as wait_paused:
            write = in_thread(lambda: session.write(transfers(PAGES), allocate=True))
            wait_paused()
            session.detach()
            _cancelled(write())
        # Both calls are answered: the session was torn down and the copy's error sent.
        _unmapped(pid, tag)
    assert daemon.process.poll() is None, daemon.log


def test_a_load_cancelled_by_detach_leaves_no_buffer_mapped(
    daemon: Daemon, worker_pools: list[WorkerPools]
) -> None:
    tag = unique_tag("unmap-l")
    pools = WorkerPools.create(tag)
    worker_pools.append(pools)
    pid = daemon.process.pid
    with HiCacheClient(daemon.target, timeout_s=WAIT_S) as client:
        session = _attach(client, pools)
        written = session.write(transfers(PAGES), allocate=True)
        assert written.ok
        host = host_pages_of(written.transfers)
        with copies_paused(daemon) as wait_paused:
            load = in_thread(lambda: session.load(transfers(PAGES, host)).wait())
            wait_paused()
            session.detach()
            _cancelled(load())
        _unmapped(pid, tag)
    assert daemon.process.poll() is None, daemon.log


def test_a_write_cancelled_by_lease_expiry_leaves_no_buffer_mapped(
    daemon: Daemon, worker_pools: list[WorkerPools]
) -> None:
    tag = unique_tag("unmap-e")
    pools = WorkerPools.create(tag)
    worker_pools.append(pools)
    pid = daemon.process.pid
    with HiCacheClient(daemon.target, timeout_s=WAIT_S) as client:
        session = _attach(client, pools, lease_ms=2000)
        assert memfd_mappings(pid, tag), "the attach mapped no memfd"
        # No heartbeat: the lease reaper ends the session while the copy waits; the session's
        # teardown then runs on the copy's own thread, before the Write is answered.
        with copies_paused(daemon) as wait_paused:
            write = in_thread(lambda: session.write(transfers(PAGES), allocate=True))
            wait_paused()
            _cancelled(write())
        _unmapped(pid, tag)
    assert daemon.process.poll() is None, daemon.log


def test_a_load_its_client_abandoned_then_cancelled_by_lease_expiry_leaves_no_buffer_mapped(
    daemon: Daemon, worker_pools: list[WorkerPools]
) -> None:
    """A worker that went away: its call is cancelled (no answer is sent, so the copy's error
    never reaches the error interceptor), then its lease runs out."""
    tag = unique_tag("unmap-a")
    pools = WorkerPools.create(tag)
    worker_pools.append(pools)
    pid = daemon.process.pid
    with HiCacheClient(daemon.target, timeout_s=WAIT_S) as client:
        session = _attach(client, pools, lease_ms=2000)
        written = session.write(transfers(PAGES), allocate=True)
        assert written.ok
        host = host_pages_of(written.transfers)
        orphans = len(log_lines(daemon, ORPHANED_TASK)) + len(log_lines(daemon, PENDING_TASK))
        with copies_paused(daemon) as wait_paused:
            stream = session.load(transfers(PAGES, host))
            wait_paused()
            stream.cancel()
            # The session ends on the reaper's thread, its teardown on the copy's, after the
            # stream's end: nothing tells when the copy's thread is done but the mappings
            # going (the collector is off, so polling cannot be what frees them).
            _unmapped(pid, tag)
    assert daemon.process.poll() is None, daemon.log
    # The stream's copy failed after its client left; its error went with it, not to the log
    # as an ERROR with a traceback (before: "Task exception was never retrieved" for each such
    # call, once the failed task was freed, which the mappings going shows).
    assert len(log_lines(daemon, ORPHANED_TASK)) + len(log_lines(daemon, PENDING_TASK)) == orphans, daemon.log
