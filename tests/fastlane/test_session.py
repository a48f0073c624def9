"""The client's Session uses the fast lane when asked (``HiCacheClient(fast_lane=True)``), through
the same methods, against a real daemon: same results and errors as gRPC, gRPC when the daemon
has no lane, and after a lane is lost the op is re-sent over gRPC with the same op_id.

Each test fails before the change (issue 13 item 2): ``HiCacheClient`` had no ``fast_lane``
and a Session never opened a lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hicached_client import (
    AsyncHiCacheClient,
    HiCacheClient,
    HiCacheError,
    Session,
    TokenChain,
    Transfer,
    WorkerIdentity,
)
from hicached_client import lane_wire as w

from tests.fastlane.conftest import free_pages
from tests.fastlane.test_lifecycle import daemon_resources
from tests.support.daemon import ROOT, Daemon, start_daemon
from tests.support.kv import PAGE_SIZE, WorkerPools, unique_tag
from tests.support.state import poll, stop_process

PAGES = 8


def _attach(client: HiCacheClient, pools: WorkerPools) -> Session:
    return client.attach(WorkerIdentity(f"s-{uuid.uuid4().hex[:8]}", 1, "m-fastlane"), pools.specs())


def _outcome(call: Callable[[], Any], session_id: str) -> Any:
    """What a call answered: its result, or its error's code, message (session id masked) and RPC."""
    try:
        return call()
    except HiCacheError as exc:
        return (exc.code, exc.message.replace(session_id, "<sid>"), exc.method)


def _script(session: Session, pools: WorkerPools) -> list[Any]:
    """The hot operations through the Session's own methods, with a byte-exact round trip."""
    pools.fill_random(31)
    src, dst = list(range(PAGES)), list(range(300, 300 + PAGES))
    expected = pools.pages("kv", src).clone()
    out: list[Any] = []
    written = session.write([Transfer("kv", src), Transfer("draft", src)], allocate=True)
    out.append(
        (written.ok, written.acks, [(t.pool, t.device_pages, t.host_allocated) for t in written.transfers])
    )
    pools.clobber()
    loaded = session.load_wait([Transfer(t.pool, dst, t.host_pages) for t in written.transfers])
    out.append((sorted(loaded.layers), loaded.acks, bool((pools.pages("kv", dst) == expected).all())))
    resolved = session.resolve_transfers([Transfer("kv", [1, 2])])
    out.append((resolved.ok, [(t.pool, t.device_pages, len(t.host_pages)) for t in resolved.transfers]))
    out.append(session.release_transfers(list(resolved.transfers)))
    out.append(session.release_transfers(list(written.transfers)))
    sid = session.session_id
    for bad in (
        [Transfer("kv", [-1])],
        [Transfer("kv", [5000])],
        [Transfer("nope", [1])],
        [Transfer("kv", [1, 1])],
    ):
        out.append(_outcome(lambda bad=bad: session.write(bad, allocate=True), sid))
    out.append(_outcome(lambda: session.load_wait([Transfer("kv", [1], [10**6])]), sid))
    out.append(_outcome(lambda: session.release_transfers([Transfer("kv", [1], [10**6])]), sid))
    return out + _keyed_script(session, pools)


def _both(pages: list[int]) -> list[Transfer]:
    return [Transfer("kv", pages), Transfer("draft", pages)]


def _keyed_script(session: Session, pools: WorkerPools) -> list[Any]:
    """PutPages / GetPages by given keys (fresh per run), byte-exact, and their refusals."""
    keys = [uuid.uuid4().hex for _ in range(4)]
    src, dst = list(range(20, 24)), list(range(400, 405))
    expected = {name: pools.pages(name, src).clone() for name in ("kv", "draft")}
    out: list[Any] = []
    put = session.put_pages(keys, _both(src))
    out.append((put.ok, put.stored_pages, put.existing_pages, put.acks, put.reason))
    again = session.put_pages([*keys[:2], uuid.uuid4().hex], _both(src[:3]))
    out.append((again.ok, again.stored_pages, again.existing_pages))
    pools.clobber()
    got = session.get_pages([*keys, uuid.uuid4().hex], _both(dst))
    same = all(bool((pools.pages(n, dst[:4]) == expected[n]).all()) for n in expected)
    out.append((got.hit_pages, got.acks, same, pools.untouched("kv", dst[:4])))
    out.append(session.get_pages(keys, _both(dst[:4]), include_l3=True).hit_pages)
    found = session.lookup([*keys, uuid.uuid4().hex, keys[0]])
    out.append((found.keys[:4] == tuple(keys), found.l2_hit_pages, found.total_hit_pages))
    out.append(session.lookup([uuid.uuid4().hex, *keys]).total_hit_pages)
    sid = session.session_id
    for call in (
        lambda: session.get_pages(keys[:2], _both([1, 2, 3])),
        lambda: session.get_pages(keys[:1], [Transfer("nope", [1])]),
        lambda: session.put_pages(["k" * 600], _both([1])),
        lambda: session.put_pages(keys[:1], [Transfer("kv", [1])]),
        lambda: session.get_pages(keys[:1], _both([10**6])),
        lambda: session.lookup([keys[0], "k" * 600]),
    ):
        out.append(_outcome(call, sid))
    return out


def test_the_session_gives_the_same_results_and_errors_with_and_without_the_lane(
    daemon: Daemon, pools: WorkerPools
) -> None:
    with HiCacheClient(daemon.target, timeout_s=30.0) as plain:
        session = _attach(plain, pools)
        via_grpc = _script(session, pools)
        session.close()
    conns = daemon_resources(daemon)[2]
    with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as fast:
        session = _attach(fast, pools)
        via_lane = _script(session, pools)
        assert daemon_resources(daemon)[2] >= conns + 1, "the session opened a lane"
        session.close()
    assert via_lane == via_grpc
    assert all(isinstance(e, tuple) and e[0] != grpc.StatusCode.OK for e in via_grpc[5:11])
    keyed = via_grpc[11:]
    assert keyed[0][:3] == (True, 4, 0) and keyed[1] == (True, 1, 2), keyed
    assert keyed[2][0] == 4 and keyed[2][2] and keyed[3] == 4, "4 pages hit, byte-exact, nothing else written"
    assert keyed[4] == (True, 4, 4) and keyed[5] == 0, "lookup: the leading run of 4 keys, none after a miss"
    assert all(isinstance(e, tuple) and e[0] != grpc.StatusCode.OK for e in keyed[6:]), keyed[6:]


def test_calls_the_lane_cannot_carry_and_async_sessions_still_work(
    daemon: Daemon, pools: WorkerPools
) -> None:
    async def main() -> None:
        async with AsyncHiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client:
            session = await client.attach(WorkerIdentity("s-aio", 1, "m-fastlane"), pools.specs())
            written = await session.write([Transfer("kv", [1, 2])], allocate=True)  # over the lane
            # Primary pages (the anchor pool and its sidecars at once) are gRPC's alone.
            fenced = await session.write([], allocate=True, primary_device_pages=[3])
            assert written.ok and fenced.ok
            loaded = await session.load_wait([Transfer("kv", [5, 6], written.transfers[0].host_pages)])
            assert loaded.acks[0].pages == 2
            assert await session.release_transfers(list(written.transfers)) == 2
            assert await session.release_transfers(list(fenced.transfers)) == len(fenced.transfers)
            keys = [uuid.uuid4().hex, uuid.uuid4().hex]
            put = await session.put_pages(keys, _both([1, 2]))  # over the lane, awaited
            assert (put.ok, put.stored_pages) == (True, 2)
            assert (await session.get_pages(keys, _both([7, 8]))).hit_pages == 2
            assert (
                session._slot._lane is not None and session._slot._lane.lane._tail == 6
            )  # 4 earlier records, put, get
            await session.close()

    asyncio.run(main())


@pytest.mark.parametrize("op_id", ["x" * 40, "a b", "é-op"], ids=["long", "space", "non-ascii"])
def test_an_op_id_the_lane_cannot_carry_goes_over_grpc(
    daemon: Daemon, pools: WorkerPools, op_id: str
) -> None:
    """Fails before (a review of stop 46): gRPC takes any op id within
    limits.max_identity_bytes, a lane record at most 32 printable ASCII characters; with
    ``fast_lane=True`` such an op raised ValueError, UnicodeEncodeError or INVALID_ARGUMENT
    where gRPC answered it. Now it goes over gRPC, and a replay of its id still answers it."""
    with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client:
        session = _attach(client, pools)
        written = session.write(_both([1, 2]), allocate=True, op_id=op_id)
        assert written.ok, written
        assert session.write(_both([1, 2]), allocate=True, op_id=op_id) == written  # the same op
        assert session.release_transfers(list(written.transfers), op_id=f"{op_id}-release") == 4
        keys = [uuid.uuid4().hex]
        assert session.put_pages(keys, _both([3]), op_id=f"{op_id}-put").stored_pages == 1
        assert session.get_pages(keys, _both([4]), op_id=f"{op_id}-get").hit_pages == 1
        assert session._slot._lane is None, "none of them opened the lane"
        resolved = session.resolve_transfers(_both([5]))  # a fresh id: over the lane
        assert resolved.ok and session._slot._lane is not None
        session.close()


def test_a_daemon_without_the_lane_is_served_over_grpc(pools: WorkerPools) -> None:
    d = start_daemon("--set", "server.fast_lane=false")
    try:
        with HiCacheClient(d.target, timeout_s=30.0, fast_lane=True) as client:
            session = _attach(client, pools)
            written = session.write([Transfer("kv", [1, 2])], allocate=True)
            assert written.ok and written.acks[0].pages == 2
            assert (
                session.load_wait([Transfer("kv", [4, 5], written.transfers[0].host_pages)]).acks[0].pages
                == 2
            )
            assert session.release_transfers(list(written.transfers)) == 2
            session.close()
    finally:
        d.stop()


def test_after_the_lane_is_lost_the_op_is_resent_over_grpc_with_its_op_id(
    daemon: Daemon, pools: WorkerPools
) -> None:
    """The daemon shares one op-id ledger between the lane and gRPC: a Write answered on the lane,
    re-sent after the lane died, is answered over gRPC from that ledger (no second allocation)."""
    with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client:
        session = _attach(client, pools)
        batch = [Transfer("kv", [1, 2, 3])]
        first = session.write(batch, allocate=True, op_id="lost-lane-1")  # on the lane
        lane = session._slot._lane
        assert lane is not None, "the write went over the lane"
        free = free_pages(session)
        # Break the ring protocol: the daemon closes this lane (and only this lane).
        lane._counters[w.SQ_TAIL // 8] = 1000
        os.eventfd_write(lane._submit, 1)
        # Wait for the daemon's end of the socket to close: the lane's poller also watches the
        # completion doorbell, which an earlier answer may have left readable, and a write sent
        # before the daemon read the broken tail would overwrite it and go through on the lane.
        poll(
            lambda: select.select([lane._conn], [], [], 0)[0], bool, 10, "the daemon closing the broken lane"
        )
        again = session.write(batch, allocate=True, op_id="lost-lane-1")  # lane fails: gRPC
        assert session._slot._lane is None and lane.closed, "the lost lane was dropped"
        assert again == first, "gRPC answered from the ledger: the same host pages"
        assert free_pages(session) == free, "the write was not applied twice"
        fresh = session.write(batch, allocate=True)  # the session goes on over gRPC
        assert fresh.ok and fresh.transfers[0].host_pages != first.transfers[0].host_pages
        assert session.release_transfers(list(first.transfers)) == 3
        assert session.release_transfers(list(fresh.transfers)) == 3
        session.close()


def test_closing_the_client_closes_its_sessions_lanes(daemon: Daemon, pools: WorkerPools) -> None:
    """Before: nothing closed a session's lane but the session itself (its fds stayed open)."""
    client = HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True)
    session = _attach(client, pools)
    written = session.write([Transfer("kv", [1])], allocate=True)
    lane = session._slot._lane
    assert lane is not None and not lane.closed
    client.close()
    assert lane.closed, "the client closed its session's lane"
    with HiCacheClient(daemon.target, timeout_s=30.0) as again:  # the session stays attached
        same = again.session(session.session_id, session_secret=session.info.session_secret)
        assert same.release_transfers(list(written.transfers)) == 1
        same.close()


DYING = """
import os, sys
from hicached_client import HiCacheClient, Transfer, WorkerIdentity
from tests.support.kv import WorkerPools
pools = WorkerPools.create(sys.argv[2])
client = HiCacheClient(sys.argv[1], fast_lane=True)
session = client.attach(WorkerIdentity("dying-" + sys.argv[2], 1, "m-fastlane"), pools.specs())
assert session.write([Transfer("kv", list(range(64)))], allocate=True).ok
assert session._slot._lane is not None, "the write went over the lane"
print(session.session_id, flush=True)
os._exit(0)  # killed: no close, no detach
"""


def test_a_killed_worker_leaks_nothing_of_its_sessions_lane(daemon: Daemon, admin: HiCacheClient) -> None:
    baseline = daemon_resources(daemon)
    tag = unique_tag("fls-dying")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", DYING, daemon.target, tag], cwd=ROOT, capture_output=True, text=True, timeout=120,
            check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        sid = proc.stdout.strip()
        poll(
            lambda: admin.get_stats().session(sid),
            lambda s: s is None,
            15,
            "the dead worker's session expired",
        )
        poll(
            lambda: daemon_resources(daemon),
            lambda r: all(now <= then for now, then in zip(r, baseline, strict=True)),
            15,
            "the dead worker's lane freed",
        )
    finally:
        for pool in ("kv", "draft"):
            Path(f"/dev/shm/hct-{tag}-{pool}").unlink(missing_ok=True)
    assert daemon.process.poll() is None


def test_keyed_pages_go_over_the_lane_and_a_lost_lane_resends_them_with_their_op_id(
    daemon: Daemon, pools: WorkerPools
) -> None:
    """GetPages/PutPages/Lookup with given keys ride the lane (one ring record each); a token
    chain goes over gRPC; after the lane is lost a PutPages re-sent with its op_id is answered
    from the session's one ledger, not stored twice. Before: keyed calls were gRPC only."""
    pools.fill_random(5)
    keys = [uuid.uuid4().hex for _ in range(3)]
    with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client:
        session = _attach(client, pools)
        put = session.put_pages(keys, _both([1, 2, 3]), op_id="keyed-put-1")
        lane = session._slot._lane
        assert lane is not None and lane._tail == 1, "the PutPages was the lane's first record"
        assert session.get_pages(keys, _both([7, 8, 9])).hit_pages == 3
        assert lane._tail == 2, "the GetPages went over the lane"
        assert session.lookup([*keys, uuid.uuid4().hex]).l2_hit_pages == 3
        assert lane._tail == 3, "the Lookup went over the lane"
        chain = TokenChain(token_ids=list(range(4 * PAGE_SIZE)))  # 4 pages never stored
        assert session.get_pages(chain, _both([10, 11, 12, 13])).hit_pages == 0
        assert session.lookup(chain).total_hit_pages == 0
        assert lane._tail == 3, "a token chain goes over gRPC"
        lane._counters[w.SQ_TAIL // 8] = 1000  # break the ring: the daemon closes this lane
        os.eventfd_write(lane._submit, 1)
        # Wait for the daemon's end of the socket to close: the lane's poller also watches the
        # completion doorbell, which an earlier answer may have left readable, and a write sent
        # before the daemon read the broken tail would overwrite it and go through on the lane.
        poll(
            lambda: select.select([lane._conn], [], [], 0)[0], bool, 10, "the daemon closing the broken lane"
        )
        again = session.put_pages(keys, _both([1, 2, 3]), op_id="keyed-put-1")
        assert session._slot._lane is None and lane.closed
        assert again == put and put.stored_pages == 3, "answered from the ledger, over gRPC"
        session.close()


@contextlib.contextmanager
def _daemon_stalled_with_one_lane(daemon: Daemon) -> Iterator[None]:
    """The daemon stopped (every thread) while this session's lane is its only one; resumed
    after, and then waited for until it has ended that lane (its thread saw the close)."""
    poll(lambda: daemon_resources(daemon), lambda r: r == (1, 1, 1), 10, "only this session's lane")
    stop_process(daemon.process.pid)
    try:
        yield
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    poll(lambda: daemon_resources(daemon), lambda r: r == (0, 0, 0), 10, "the daemon ending the lane")


def test_an_op_that_timed_out_on_the_lane_never_runs_later(daemon: Daemon, pools: WorkerPools) -> None:
    """Fails before: a lane op past its timeout stayed in the ring, and the daemon ran it once it
    could (here: once resumed), after the caller had been told it failed and had reused its
    pages: a review's SGLang adapter stored another batch's bytes under the keys whose store
    had failed, and wrote pages into host memory SGLang had handed out again. Now the client
    closes the lane when it gives up on an op, the daemon runs no request it had not taken
    once the lane's connection is closed, and the session's later ops go over gRPC."""
    pools.fill_random(6)
    keys = [uuid.uuid4().hex for _ in range(3)]
    with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client:
        session = _attach(client, pools)
        assert session.lookup(keys).l2_hit_pages == 0  # the lane is open (its first record)
        lane = session._slot._lane
        assert lane is not None
        with _daemon_stalled_with_one_lane(daemon), pytest.raises(HiCacheError) as err:
            session.put_pages(keys, _both([1, 2, 3]), timeout_s=0.5)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert lane.closed and session._slot._lane is None
        # The lane's thread has ended: it saw the close before the PutPages, which never ran.
        assert session.lookup(keys).l2_hit_pages == 0
        assert session.get_pages(keys, _both([7, 8, 9])).hit_pages == 0
        assert session.put_pages(keys, _both([1, 2, 3])).stored_pages == 3  # the session works on
        session.close()


def test_an_async_op_that_timed_out_on_the_lane_never_runs_later(daemon: Daemon, pools: WorkerPools) -> None:
    """The asyncio lane as the blocking one above (fails before alike: the op stayed in the
    ring, and the lane stayed open)."""
    pools.fill_random(8)
    keys = [uuid.uuid4().hex for _ in range(2)]

    async def main() -> None:
        async with AsyncHiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client:
            session = await client.attach(
                WorkerIdentity(f"s-{uuid.uuid4().hex[:8]}", 1, "m-fastlane"), pools.specs()
            )
            assert (await session.lookup(keys)).l2_hit_pages == 0  # opens the lane
            lane = session._slot._lane
            assert lane is not None
            with _daemon_stalled_with_one_lane(daemon), pytest.raises(HiCacheError) as err:
                await session.put_pages(keys, _both([1, 2]), timeout_s=0.5)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
            assert lane.closed and session._slot._lane is None
            assert (await session.lookup(keys)).l2_hit_pages == 0
            await session.close()

    asyncio.run(main())


def test_an_op_that_waited_behind_a_timed_out_one_ends_within_its_own_timeout(
    daemon: Daemon, pools: WorkerPools
) -> None:
    """Fails before: an op that waited for the lane behind one that timed out found the lane
    closed and was re-sent over gRPC with a fresh timeout, so it ended after about twice its
    own. Now its tries share one deadline: the gRPC re-send gets what is left."""
    keys = [uuid.uuid4().hex for _ in range(2)]
    with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client:
        # A lease that outlives the stall (the daemon's clock runs on while it is stopped).
        identity = WorkerIdentity(f"s-{uuid.uuid4().hex[:8]}", 1, "m-fastlane")
        session = client.attach(identity, pools.specs(), lease_ms=60_000)
        assert session.lookup(keys).l2_hit_pages == 0  # opens the lane
        lane = session._slot._lane
        assert lane is not None
        first: list[BaseException] = []

        def first_op() -> None:
            try:
                session.lookup(keys, timeout_s=1.0)
            except HiCacheError as exc:
                first.append(exc)

        with _daemon_stalled_with_one_lane(daemon):
            thread = threading.Thread(target=first_op)
            thread.start()
            poll(lambda: lane._tail, lambda tail: tail == 2, 10, "the first op sent on the lane")
            started = time.monotonic()
            with pytest.raises(HiCacheError) as err:
                session.lookup(keys, timeout_s=2.0)  # waits for the lane until the first op times out
            took = time.monotonic() - started
            thread.join()
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert [e.code for e in first if isinstance(e, HiCacheError)] == [grpc.StatusCode.DEADLINE_EXCEEDED]
        assert took < 2.5, f"the second op took {took:.2f} s for its 2 s timeout"
        assert lane.closed and session.lookup(keys).l2_hit_pages == 0  # on over gRPC
        session.close()


def test_an_op_with_no_time_left_for_the_lane_is_not_sent_and_keeps_the_lane(
    daemon: Daemon, pools: WorkerPools
) -> None:
    """Fails before: an op left with almost none of its timeout once it held the lane was sent,
    timed out and closed the lane for good (the session on gRPC from then on). Now it is not
    sent: DEADLINE_EXCEEDED, the lane still open and serving."""
    keys = [uuid.uuid4().hex for _ in range(2)]
    with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client:
        session = _attach(client, pools)
        assert session.lookup(keys).l2_hit_pages == 0  # opens the lane
        lane = session._slot._lane
        assert lane is not None
        stop_process(daemon.process.pid)  # were it sent, nothing would answer it
        try:
            with pytest.raises(HiCacheError) as err:
                session.lookup(keys, timeout_s=0.0002)
            with pytest.raises(HiCacheError) as load_err:  # the blocking Load took another way
                session.load_wait(_both([1, 2]), timeout_s=0.0002)
        finally:
            os.kill(daemon.process.pid, signal.SIGCONT)
        assert err.value.code == load_err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert lane._tail == 1 and not lane.closed and session._slot._lane is lane
        assert session.lookup(keys).l2_hit_pages == 0
        assert lane._tail == 2, "the next op went over the lane"
        session.close()
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:  # gRPC alone answers the same
        session = _attach(client, pools)
        with pytest.raises(HiCacheError) as err:
            session.lookup(keys, timeout_s=0)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert str(err.value).startswith("Lookup: "), err.value
        session.close()
