"""A call whose work grows with its size never holds the event loop (a review of stop 45):
an allocation that zeroes reused pages, and an attach that builds a pool group. Each daemon
is patched (:mod:`tests.support.faults`) so that the big step waits for a line on its stdin:
the other sessions' calls must be answered while it waits, which is what a large step does
for seconds on a real node. And populating a mapping lets the other threads run."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable

import pytest
from hicached_client import AllocResult, HiCacheClient, HiCacheError, PageBytes, Transfer, WorkerIdentity

from hicached import shm
from tests.robustness.loop_support import HOST_PAGES, PAGE_BYTES, attach_bytes, byte_spec
from tests.support.daemon import Daemon
from tests.support.faults import log_lines, serve_patched
from tests.support.state import poll

# Every zeroing of reused pages waits until stdin has a line; "ZEROING n" says one started.
HELD_ZEROING = """
import sys, threading
import hicached.l2.host_pool as hp
_go = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), _go.set()), daemon=True).start()
_zero = hp.HostKVPool.zero_pages
def zero_pages(self, pages):
    print("ZEROING", len(pages), flush=True)
    _go.wait()
    return _zero(self, pages)
hp.HostKVPool.zero_pages = zero_pages
"""

# Building the pool group of model m-slow waits for a line on stdin; "BUILDING" says it started.
HELD_BUILD = """
import sys
import hicached.core.groups as g
_build = g.GroupRegistry._build
def _build_held(self, gid, model, pools, plan):
    if model == "m-slow":
        print("BUILDING", flush=True)
        sys.stdin.readline()
    return _build(self, gid, model, pools, plan)
g.GroupRegistry._build = _build_held
"""


def _while_held(
    d: Daemon, release: int, started: str, big: Callable[[], object], probe: Callable[[], None]
) -> None:
    """Run ``big`` in a thread until the daemon logs ``started``, then ``probe`` (which must
    answer while ``big`` is held), then release ``big`` and check it succeeded."""
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(big()))
    thread.start()
    try:
        poll(lambda: log_lines(d, started), bool, 30, f"the daemon logging {started}")
        probe()
    finally:
        os.write(release, b"go\n")
        thread.join(timeout=60)
    assert outcome and not isinstance(outcome[0], BaseException), outcome


def _reuse_every_page(client: HiCacheClient) -> None:
    """Another session of the group takes every page and frees it: 16 MiB of pages the pool
    holds as an earlier owner's, which the hostile session's allocations zero (its own freed
    pages would come back to it unzeroed)."""
    earlier = client.attach(WorkerIdentity("earlier", 1, "m-big"), [byte_spec(256)], heartbeat=False)
    earlier.free("kv", earlier.alloc("kv", 256).host_pages)
    earlier.detach()


def test_large_allocations_zero_their_pages_behind_no_other_kind_of_call() -> None:
    """Fails before: Alloc and ResolveTransfers ran on the event loop, zeroing the reused pages
    there (a review measured 0.33 s per 4 GiB Alloc, and every other session's heartbeat
    waited behind each: p50 1.2 -> 298 ms); here the held zeroing holds the loop, and the
    bystander's heartbeat times out. And on the bookkeeping lane (a first fix), nine held
    Allocs of one client took its eight threads: the bystander's GetStats and Attach timed
    out. Now an allocation that may zero more than a MiB runs on a lane of its own."""
    read, release = os.pipe()
    # Ten held Allocs of one session: its limit on the alloc lane raised to let them queue.
    d = serve_patched(HELD_ZEROING, "--set", "limits.max_alloc_calls_per_session=16", stdin=read)
    os.close(read)
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            hostile = client.attach(WorkerIdentity("hostile", 1, "m-big"), [byte_spec(256)], heartbeat=False)
            bystander = attach_bytes(client, "m-by")
            _reuse_every_page(client)
            assert 20 * PAGE_BYTES > 1 << 20
            allocs = [threading.Thread(target=hostile.alloc, args=("kv", 20)) for _ in range(9)]

            def probe() -> None:
                poll(lambda: len(log_lines(d, "ZEROING")), lambda n: n >= 2, 30, "the lane's threads zeroing")
                bystander.heartbeat(timeout_s=5.0)
                small = bystander.alloc("kv", 4, timeout_s=5.0)  # fresh pages: no zeroing, on the loop
                assert small.ok and bystander.free("kv", small.host_pages) == 4
                assert bystander.stats(timeout_s=5.0).host_used_bytes > 0
                identity = WorkerIdentity("newcomer", 1, "m-new")
                client.attach(identity, [byte_spec()], heartbeat=False, timeout_s=5.0).close()

            def big() -> object:
                for t in allocs:
                    t.start()
                return hostile.alloc("kv", 20)

            try:
                _while_held(d, release, "ZEROING", big, probe)
            finally:
                for t in allocs:
                    t.join(timeout=60)
    finally:
        os.close(release)
        d.stop()


def test_a_session_queues_a_bounded_number_of_large_allocations() -> None:
    """Fails before (a review of stop 46): the alloc lane had no bound, and each call waiting
    for it held its request: one session queueing ten ResolveTransfers of 2 M device pages
    behind two held allocations grew the daemon by 489 MiB, though none could ever run (each
    over server.max_batch_pages). Now a request over server.max_batch_pages is refused on the
    event loop, before any lane, and a session has at most limits.max_alloc_calls_per_session
    calls on the alloc lane; another session's large allocation still waits its turn."""
    read, release = os.pipe()
    d = serve_patched(HELD_ZEROING, "--set", "limits.max_alloc_calls_per_session=2", stdin=read)
    os.close(read)
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            hostile = client.attach(WorkerIdentity("hostile", 1, "m-big"), [byte_spec(256)], heartbeat=False)
            other = attach_bytes(client, "m-other")
            _reuse_every_page(client)
            held = [threading.Thread(target=hostile.alloc, args=("kv", 20)) for _ in range(2)]
            for t in held:
                t.start()
            outcome: list[object] = []
            queued = threading.Thread(target=lambda: outcome.append(other.alloc("kv", HOST_PAGES // 2)))
            try:
                poll(lambda: len(log_lines(d, "ZEROING")), lambda n: n >= 2, 30, "the lane's threads zeroing")
                with pytest.raises(HiCacheError) as third:
                    hostile.alloc("kv", 20, timeout_s=5.0)
                assert third.value.code.name == "RESOURCE_EXHAUSTED", third.value
                assert "limits.max_alloc_calls_per_session=2" in third.value.message, third.value
                over = 65_537  # server.max_batch_pages + 1
                for name, call in {
                    "Alloc": lambda: hostile.alloc("kv", over, timeout_s=5.0),
                    "ResolveTransfers": lambda: other.resolve_transfers(
                        [Transfer("kv", range(over))], timeout_s=5.0
                    ),
                }.items():
                    with pytest.raises(HiCacheError) as refused:
                        call()
                    assert refused.value.code.name == "INVALID_ARGUMENT", (name, refused.value)
                    assert "server.max_batch_pages=65536" in refused.value.message, (name, refused.value)
                queued.start()  # another session: waits for the lane, not refused
            finally:
                os.write(release, b"go\n")
                for t in (*held, queued):
                    if t.ident is not None:
                        t.join(timeout=60)
            [got] = outcome
            assert isinstance(got, AllocResult) and got.ok, got
    finally:
        os.close(release)
        d.stop()


# Every PutBytes waits, once it runs, until stdin has a line; "PUTTING" says one started.
HELD_PUTS = """
import sys, threading
import hicached.core.keyed as k
_go = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), _go.set()), daemon=True).start()
_put = k.KeyedCache.put_bytes
def put_bytes(self, *args, **kwargs):
    print("PUTTING", flush=True)
    _go.wait()
    return _put(self, *args, **kwargs)
k.KeyedCache.put_bytes = put_bytes
"""


def test_a_large_allocation_waits_for_no_copy_and_no_copy_limit() -> None:
    """A large allocation off the loop must not join the copy lane: behind its copies it waited
    for them (a review's bystander Alloc took 4.99 s), and under its per-session limit a
    worker with ``limits.max_copy_calls_per_session`` copies in flight was refused an Alloc it
    always had (RESOURCE_EXHAUSTED, no retry hint)."""
    read, release = os.pipe()
    d = serve_patched(HELD_PUTS, "--set", "limits.max_copy_calls_per_session=2", stdin=read)
    os.close(read)
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            worker = attach_bytes(client, "m-busy")
            puts = [
                threading.Thread(
                    target=worker.put_bytes, args=([PageBytes(f"k{i}", "kv", bytes(PAGE_BYTES))],)
                )
                for i in range(2)  # limits.max_copy_calls_per_session
            ]
            for t in puts:
                t.start()
            try:
                poll(lambda: len(log_lines(d, "PUTTING")), lambda n: n == 2, 30, "2 PutBytes running")
                got = worker.alloc("kv", HOST_PAGES // 2, timeout_s=5.0)  # 2 MiB: off the loop
                assert got.ok and len(got.host_pages) == HOST_PAGES // 2
            finally:
                os.write(release, b"go\n")
                for t in puts:
                    t.join(timeout=60)
    finally:
        os.close(release)
        d.stop()


def test_an_attach_building_a_pool_group_holds_no_other_sessions_call() -> None:
    """Fails before: the registry looked a session's group up under the lock a build holds for
    as long as it reserves and populates its pools (seconds for GiBs), on the event loop for
    every page call and each gauge refresh: a review's bystander waited 5.86 s and lost its
    lease. Now lookups read a copy of the registry made under the lock, and the bytes of the
    group being built are counted while it is built."""
    read, release = os.pipe()
    d = serve_patched(HELD_BUILD, stdin=read)
    os.close(read)
    try:
        with (
            HiCacheClient(d.target, timeout_s=30.0) as client,
            HiCacheClient(d.target, timeout_s=30.0) as other,
        ):
            bystander = attach_bytes(client, "m-by")
            before = bystander.stats(timeout_s=5.0).host_used_bytes
            during: list[int] = []

            def probe() -> None:
                bystander.heartbeat(timeout_s=5.0)
                got = bystander.alloc("kv", 4, timeout_s=5.0)
                assert got.ok and bystander.free("kv", got.host_pages, timeout_s=5.0) == 4
                during.append(bystander.stats(timeout_s=5.0).host_used_bytes)  # GetStats too

            def attach_slow() -> object:
                try:
                    return attach_bytes(other, "m-slow")
                except HiCacheError as exc:
                    return exc

            _while_held(d, release, "BUILDING", attach_slow, probe)
            # The group being built counts from the start of its build (its memory is taken
            # then; it counted only once published, so GetStats under-reported meanwhile).
            after = bystander.stats(timeout_s=5.0).host_used_bytes
            assert during == [after] and after > before, (before, during, after)
    finally:
        os.close(release)
        d.stop()


def test_populating_a_mapping_lets_other_threads_run() -> None:
    """Fails before: ``mmap.madvise`` held the GIL while the kernel populated the mapping (a
    review measured 1.89 s for 2 GiB, and a worker's attach of a backed 4 GiB memfd held every
    other session's call 1.28 s). Now the call goes through libc, a chunk at a time."""
    size = 512 << 20
    fd = os.memfd_create("hicached-test-populate")
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        gaps: list[float] = []
        done = threading.Event()

        def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                done.wait(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        thread = threading.Thread(target=ticker)
        thread.start()
        start = time.perf_counter()
        try:
            assert shm._madvise(mm, shm._MADV_POPULATE_WRITE)
        finally:
            took = time.perf_counter() - start
            done.set()
            thread.join()
        assert took > 0.02, f"populating 512 MiB took {took:.3f} s: too quick to tell"
        assert max(gaps) < took / 2, (max(gaps), took)
        mm.close()  # no export of the mapping is left behind
    finally:
        os.close(fd)


def test_a_peers_calls_hold_a_bounded_number_of_request_bytes() -> None:
    """Fails before (a review of stop 46): each call waiting for a lane held its request, and
    the lanes bound one session's calls, not one peer's (which may attach hundreds of
    sessions): nothing bounded what a peer's queued PutBytes held. Now a peer's calls hold at
    most limits.max_request_bytes_held_per_peer of requests (on the wire); one more is
    RESOURCE_EXHAUSTED with a retry hint, the peer's small calls still pass, and the same
    call passes once the calls ahead have ended."""
    read, release = os.pipe()
    d = serve_patched(HELD_PUTS, "--set", "limits.max_request_bytes_held_per_peer=3MiB", stdin=read)
    os.close(read)
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            # Both sessions are this process's: one peer (its uid, from the attach's handoff).
            first, second = attach_bytes(client, "m-held"), attach_bytes(client, "m-held")

            def pages(tag: str) -> list[PageBytes]:  # 2 MiB of 64 KiB pages
                return [PageBytes(f"{tag}{i}", "kv", bytes([i]) * PAGE_BYTES) for i in range(32)]

            outcome: list[object] = []
            held = threading.Thread(target=lambda: outcome.append(first.put_bytes(pages("a"))))
            held.start()
            try:
                poll(lambda: len(log_lines(d, "PUTTING")), lambda n: n == 1, 30, "the first PutBytes running")
                with pytest.raises(HiCacheError) as refused:
                    second.put_bytes(pages("b"), timeout_s=5.0)
                err = refused.value
                assert err.code.name == "RESOURCE_EXHAUSTED" and err.retry_after_ms == 100, err
                assert "limits.max_request_bytes_held_per_peer=3145728" in err.message, err
                # Small calls and session-less ones are not counted (a review of the first cut:
                # a peer at its bound lost its leases; one client's session-less calls, all
                # the socket's, refused every other client's Attach).
                second.heartbeat(timeout_s=5.0)
                attach_bytes(client, "m-held").detach()
            finally:
                os.write(release, b"go\n")
                held.join(timeout=60)
            [stored] = outcome
            assert getattr(stored, "stored_pages", None) == 32, stored
            assert second.put_bytes(pages("b"), timeout_s=10.0).stored_pages == 32
    finally:
        os.close(release)
        d.stop()
