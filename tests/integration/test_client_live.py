"""The client library against the real daemon: heartbeat keeps a lease, asyncio parity, retries."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hicached_client import AsyncHiCacheClient, HiCacheClient, HiCacheError, Stats, WorkerIdentity

from tests.integration.daemon import Daemon
from tests.integration.kv import POOLS, WorkerPools, host_pages_of, transfers, unique_tag
from tests.integration.state import poll

LEASE_MS = 600  # the daemon's minimum is 500


def test_heartbeat_keeps_the_session_alive_and_its_absence_ends_it(client: HiCacheClient) -> None:
    pools = WorkerPools.create(unique_tag("hb"))
    try:
        identity = WorkerIdentity(unique_tag("hb"), generation=1, model_name="m-heartbeat")
        session = client.attach(identity, pools.specs(), lease_ms=LEASE_MS)
        assert session.info.lease_ms == LEASE_MS
        # Six beats at lease/3 span two leases: only the heartbeat can have kept the session.
        poll(lambda: session.heartbeats, lambda n: n >= 6, timeout_s=10, what="six heartbeats")
        assert client.get_stats().session(session.session_id) is not None
        assert session.alloc("kv", 2).ok
        session.stop_heartbeat()
        assert not session.heartbeat_running
        stats: Stats = poll(
            client.get_stats,
            lambda s: s.session(session.session_id) is None,
            timeout_s=10,
            what="lease expiry after the heartbeat stopped",
        )
        assert stats.session(session.session_id) is None
        with pytest.raises(HiCacheError) as info:
            session.heartbeat()
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        session.close()  # the daemon already ended it: not an error
    finally:
        pools.close()


def test_a_retried_write_with_the_same_op_id_happens_once(client: HiCacheClient) -> None:
    pools = WorkerPools.create(unique_tag("op"))
    try:
        identity = WorkerIdentity(unique_tag("op"), generation=1, model_name="m-opid")
        with client.attach(identity, pools.specs()) as session:
            first = session.write(transfers([1, 2, 3]), allocate=True, op_id="write-1")
            again = session.write(transfers([1, 2, 3]), allocate=True, op_id="write-1")
            assert again == first, "the retry returned the first answer"
            info = session.stats().session(session.session_id)
            assert info is not None and info.owned_pages == 2 * 3, "the retry did not allocate again"
    finally:
        pools.close()


def test_async_client_round_trip_and_errors(daemon: Daemon) -> None:
    pools = WorkerPools.create(unique_tag("aio"))

    async def main() -> None:
        async with AsyncHiCacheClient(daemon.target) as client:
            identity = WorkerIdentity(unique_tag("aio"), generation=1, model_name="m-async")
            async with await client.attach(identity, pools.specs(), lease_ms=1500) as session:
                pools.fill_random(7)
                src, dst = [5, 9, 2, 7], [100, 300, 200, 400]
                expected = {p: pools.digest(p, src) for p in POOLS}
                written = await session.write(transfers(src), allocate=True)
                pools.clobber()
                layers = [
                    p.layer
                    async for p in session.load(transfers(dst, host_pages_of(written.transfers)))
                    if not p.done
                ]
                assert layers == sorted(layers) and len(layers) >= 1
                assert {p: pools.digest(p, dst) for p in POOLS} == expected
                assert await session.release_transfers(written.transfers) == 8
                with pytest.raises(HiCacheError) as info:
                    await session.alloc("nope", 1)
                assert info.value.code == grpc.StatusCode.NOT_FOUND and "'nope'" in info.value.message
            assert (await client.get_stats()).session(session.session_id) is None
            assert await client.ping(b"ok") == b"ok"

    try:
        asyncio.run(main())
    finally:
        pools.close()
