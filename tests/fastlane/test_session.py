"""The client's Session uses the fast lane when asked (``HiCacheClient(fast_lane=True)``), through
the same methods, against a real daemon: same results and errors as gRPC, gRPC when the daemon
has no lane, and after a lane is lost the op is re-sent over gRPC with the same op_id.

Each test fails before the change (issue 13 item 2): ``HiCacheClient`` had no ``fast_lane``
and a Session never opened a lane.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hicached_client import AsyncHiCacheClient, HiCacheClient, HiCacheError, Session, Transfer, WorkerIdentity
from hicached_client import lane_wire as w

from tests.fastlane.conftest import free_pages
from tests.fastlane.test_lifecycle import daemon_resources
from tests.support.daemon import ROOT, Daemon, start_daemon
from tests.support.kv import WorkerPools, unique_tag
from tests.support.state import poll

PAGES = 8


@pytest.fixture
def pools() -> Iterator[WorkerPools]:
    made = WorkerPools.create(unique_tag("fls"))
    try:
        yield made
    finally:
        made.close()


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
    assert all(isinstance(e, tuple) and e[0] != grpc.StatusCode.OK for e in via_grpc[5:])


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
            await session.close()

    asyncio.run(main())


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
        poll(lambda: lane._poller.poll(0), bool, 10, "the daemon closing the broken lane")
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
