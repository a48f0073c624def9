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

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Session, WorkerIdentity

from hicached.testing.daemon import Daemon
from tests.support.faults import log_lines, serve_patched
from tests.support.kv import WorkerPools, host_pages_of, transfers, unique_tag
from tests.support.state import memfd_mappings, poll

WAIT_S = 30.0
PAGES = list(range(256))

PATCH = """
import gc, os
gc.disable()
from hicached.transfer import engine

_check_stop = engine.CopyEngine._check_stop

def _paused_check(job):
    # A job's first check is before its ready fence; the second, before its first pages.
    job.checks = getattr(job, "checks", 0) + 1
    if job.checks == 2 and os.path.exists("pause-copies"):
        print("copy paused", flush=True)
        job.stop.wait(60)  # set by the session's end (CopyEngine.cancel_owner)
    _check_stop(job)

engine.CopyEngine._check_stop = staticmethod(_paused_check)
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = serve_patched(PATCH)
    try:
        yield d
    finally:
        d.stop()


class Paused:
    """Runs one call on a thread while copies pause; :meth:`error` is what the call raised."""

    def __init__(self, daemon: Daemon, call: Callable[[], object]) -> None:
        self._daemon = daemon
        self._seen = len(log_lines(daemon, "copy paused"))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        (daemon.workdir / "pause-copies").touch()
        self._thread.start()
        poll(
            lambda: len(log_lines(daemon, "copy paused")),
            lambda n: n > self._seen,
            WAIT_S,
            "the copy pausing in flight",
        )

    def _run(self, call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:
            self._error = exc

    def error(self) -> BaseException | None:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the paused call never returned"
        (self._daemon.workdir / "pause-copies").unlink()
        return self._error


def _attach(client: HiCacheClient, pools: WorkerPools, lease_ms: int = 0) -> Session:
    return client.attach(
        WorkerIdentity(unique_tag("unmap"), 1, "m-unmap"), pools.specs(), lease_ms=lease_ms, heartbeat=False
    )


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
        paused = Paused(daemon, lambda: session.write(transfers(PAGES), allocate=True))
        session.detach()
        _cancelled(paused.error())
        # Both calls are answered: the session was torn down and the copy's error sent.
        assert memfd_mappings(pid, tag) == []
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
        paused = Paused(daemon, lambda: session.load(transfers(PAGES, host)).wait())
        session.detach()
        _cancelled(paused.error())
        assert memfd_mappings(pid, tag) == []
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
        paused = Paused(daemon, lambda: session.write(transfers(PAGES), allocate=True))
        _cancelled(paused.error())
        assert memfd_mappings(pid, tag) == []
    assert daemon.process.poll() is None, daemon.log
