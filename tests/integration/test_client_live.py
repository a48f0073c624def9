"""The client library against the real daemon: heartbeat keeps a lease, asyncio parity, retries."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hicached_client import (
    AsyncHiCacheClient,
    HiCacheClient,
    HiCacheError,
    PageBytes,
    PoolInfo,
    PrefetchState,
    Session,
    Stats,
    TokenChain,
    WorkerIdentity,
)

from tests.support.daemon import Daemon
from tests.support.kv import POOLS, WorkerPools, host_pages_of, transfers, unique_tag
from tests.support.state import poll

LEASE_MS = 600  # the daemon's minimum is 500


def test_heartbeat_keeps_the_session_alive_and_its_absence_ends_it(
    client: HiCacheClient, admin: HiCacheClient
) -> None:
    pools = WorkerPools.create(unique_tag("hb"))
    try:
        identity = WorkerIdentity(unique_tag("hb"), generation=1, model_name="m-heartbeat")
        session = client.attach(identity, pools.specs(), lease_ms=LEASE_MS)
        assert session.info.lease_ms == LEASE_MS
        # Six beats at lease/3 span two leases: only the heartbeat can have kept the session.
        poll(lambda: session.heartbeats, lambda n: n >= 6, timeout_s=10, what="six heartbeats")
        assert admin.get_stats().session(session.session_id) is not None
        assert session.alloc("kv", 2).ok
        session.stop_heartbeat()
        assert not session.heartbeat_running
        stats: Stats = poll(
            admin.get_stats,
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
            with HiCacheClient(daemon.admin_target) as admin:
                assert admin.get_stats().session(session.session_id) is None
            assert await client.ping(b"ok") == b"ok"

    try:
        asyncio.run(main())
    finally:
        pools.close()


def test_content_cache_methods_over_the_wire(client: HiCacheClient) -> None:
    """Every keyed RPC through the typed client: put/lookup/get pages, bytes, publish, prefetch, clear."""
    pools = WorkerPools.create(unique_tag("keyed"))
    try:
        identity = WorkerIdentity(unique_tag("keyed"), generation=1, model_name="m-keyed", tenant="tenant-a")
        with client.attach(identity, pools.specs()) as s:
            pools.fill_random(3)
            chain = TokenChain(list(range(16)), cache_salt="tenant-a")  # 4 pages of 4 tokens
            put = s.put_pages(chain, transfers([1, 2, 3, 4]))
            assert put.ok and (put.stored_pages, put.existing_pages) == (4, 0)
            found = s.lookup(chain)
            assert len(found.keys) == 4 and found.l2_hit_pages == 4 == found.total_hit_pages
            assert (
                s.put_pages(list(found.keys), transfers([1, 2, 3, 4]), tenant="tenant-a").existing_pages == 4
            )
            got = s.get_pages(list(found.keys), transfers([10, 11, 12, 13]))
            assert got.hit_pages == 4
            assert {p: pools.digest(p, [10, 11, 12, 13]) for p in POOLS} == {
                p: pools.digest(p, [1, 2, 3, 4]) for p in POOLS
            }
            raw = s.get_bytes(list(found.keys))
            assert raw.hit_pages == 4 and sorted({(b.key, b.pool) for b in raw.pages}) == sorted(
                (k, p) for k in found.keys for p in POOLS
            )
            kv_page = pools.pages("kv", [1]).numpy().tobytes()
            assert next(b.data for b in raw.pages if b.key == found.keys[0] and b.pool == "kv") == kv_page
            fresh = [f"{i:064x}" for i in range(1, 3)]
            stored = s.put_bytes([PageBytes(k, b.pool, b.data) for k in fresh for b in raw.pages[:2]])
            assert (stored.stored_pages, stored.existing_pages) == (2, 0)
            assert s.lookup(fresh).l2_hit_pages == 2
            written = s.write(transfers([20, 21]), allocate=True)
            published = s.publish([f"{i:064x}" for i in range(3, 5)], list(written.transfers))
            assert (published.published_pages, published.existing_pages) == (2, 0)
            ticket = s.prefetch(chain, policy="best_effort")
            assert ticket.planned_pages == 0, "everything is in L2 already"
            status = s.prefetch_status(ticket.prefetch_id, wait=True)
            assert status.state is PrefetchState.DONE
            cleared = client.clear_namespace(
                "m-keyed", session_id=s.session_id, session_secret=s.info.session_secret
            )  # its own tenant
            assert cleared.l2_pages >= 8 and cleared.l3_pages == 0
            assert s.lookup(chain).l2_hit_pages == 0
    finally:
        pools.close()


def test_resolve_and_release_transfers_are_all_or_nothing(client: HiCacheClient) -> None:
    pools = WorkerPools.create(unique_tag("resolve"))
    try:
        identity = WorkerIdentity(unique_tag("resolve"), generation=1, model_name="m-resolve")
        with client.attach(identity, pools.specs()) as s:
            total = s.info.pool("kv").total_pages
            resolved = s.resolve_transfers(transfers(range(100)))
            assert resolved.ok
            assert all(t.host_allocated and len(t.host_pages or ()) == 100 for t in resolved.transfers)
            # Fill kv, the pool processed last (name order): draft allocates first and must be rolled back.
            filler = []
            while (want := total - 100 - len(filler)) > 0:
                filler += s.alloc("kv", min(want, 256)).host_pages
            declined = s.resolve_transfers(transfers(range(100, 101)))
            assert not declined.ok
            free = {p.name: p.free_pages for p in _pools_of(s)}
            assert free == {"kv": 0, "draft": total - 100}, "the draft allocation was rolled back"
            assert s.release_transfers(resolved.transfers) == 200
            free = {p.name: p.free_pages for p in _pools_of(s)}
            assert free == {"kv": 100, "draft": total}
    finally:
        pools.close()


def _pools_of(session: Session) -> tuple[PoolInfo, ...]:
    stats = session.stats()  # a worker sees its own session (its secret goes with the call)
    info = stats.session(session.session_id)
    assert info is not None
    return next(g.pools for g in stats.groups if g.group == info.group)
