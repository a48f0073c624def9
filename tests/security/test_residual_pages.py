"""A host page handed to a session holds no earlier owner's bytes.

A freed page keeps its bytes. On the code before, tenant A's Alloc on a full pool evicted
tenant B's cached entries and handed their pages to A with B's KV still in them; A
published them under keys of its own and read B's bytes back with GetBytes. Now a page
that may hold an earlier owner's bytes is zeroed before it is handed out (or overwritten
whole by the call that allocated it: PutBytes, PutPages, a Write, an L3 read).
"""

from __future__ import annotations

from hicached_client import HiCacheClient, PageBytes, Transfer, WorkerIdentity, pool_spec

from tests.support.daemon import Daemon
from tests.support.kv import WorkerPools, unique_tag

PAGES = 8
PAGE_SIZE, LAYERS, HEADS, DIM = 4, 2, 2, 16
PAGE_BYTES = PAGE_SIZE * LAYERS * HEADS * DIM * 2 * 2  # float16, K and V


def _spec() -> object:
    return pool_spec("kv", role="anchor", kind="mha", dtype="float16", page_size=PAGE_SIZE,
                     num_layers=LAYERS, num_heads=HEADS, head_dim=DIM, k_buffers=[],
                     host_bytes=PAGES * PAGE_BYTES)  # fmt: skip


def test_another_tenants_evicted_pages_come_zeroed(daemon: Daemon) -> None:
    model = unique_tag("m-resid")
    secret = [(f"TEAM-B-SECRET-{i:02d}|".encode() * PAGE_BYTES)[:PAGE_BYTES] for i in range(PAGES)]
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        victim = client.attach(
            WorkerIdentity(unique_tag("b"), 1, model, tenant="team-b"), [_spec()], heartbeat=False
        )
        stranger = client.attach(
            WorkerIdentity(unique_tag("a"), 1, model, tenant="team-a"), [_spec()], heartbeat=False
        )
        try:
            stored = victim.put_bytes([PageBytes(f"b{i}", "kv", secret[i]) for i in range(PAGES)])
            assert stored.stored_pages == PAGES  # the pool is full of B's pages
            got = stranger.alloc("kv", PAGES)  # evicts every one of B's entries
            pages = list(got.host_pages)
            assert len(pages) == PAGES
            keys = [f"a{i}" for i in range(PAGES)]
            published = stranger.publish(keys, [Transfer("kv", device_pages=[], host_pages=pages)])
            assert published.published_pages == PAGES
            read = stranger.get_bytes(keys)
            assert len(read.pages) == PAGES
            for page in read.pages:
                assert page.data == bytes(PAGE_BYTES), f"{page.key} holds {page.data[:20]!r}"
            assert victim.lookup([f"b{i}" for i in range(PAGES)]).l2_hit_pages == 0  # really evicted
        finally:
            stranger.detach()
            victim.detach()


def test_pages_a_session_freed_come_back_to_it_as_they_were_and_to_anyone_else_zeroed(
    daemon: Daemon,
) -> None:
    """A page its own session freed holds nothing that session could not read: handed back to
    it, it is not zeroed (a worker that frees and re-allocates its pages pays no memset; on the
    code before, every such page was zeroed). To another session of the group, another tenant's
    or the same worker's next session, it comes zeroed."""
    model = unique_tag("m-own")
    a_pools, b_pools = WorkerPools.create(unique_tag("own-a")), WorkerPools.create(unique_tag("own-b"))
    try:
        a_pools.fill_random(seed=11)
        b_pools.clobber()
        first, back = list(range(8)), list(range(100, 108))
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            worker_a = WorkerIdentity(unique_tag("a"), 1, model, tenant="team-a")
            a = client.attach(worker_a, a_pools.specs(), heartbeat=False)
            b = client.attach(
                WorkerIdentity(unique_tag("b"), 1, model, tenant="team-b"), b_pools.specs(), heartbeat=False
            )
            try:
                written = a.write([Transfer("kv", first)], allocate=True)
                host = list(written.transfers[0].host_pages)
                assert a.free("kv", host) == len(host)
                again = list(a.alloc("kv", len(host)).host_pages)
                assert sorted(again) == sorted(host)  # the same pages, given back to their owner
                a.load_wait([Transfer("kv", back, host)])  # host[i] holds first[i]
                assert a_pools.digest("kv", back) == a_pools.digest("kv", first)  # as it wrote them

                assert a.free("kv", again) == len(again)
                theirs = list(b.alloc("kv", len(again)).host_pages)
                assert sorted(theirs) == sorted(host)  # the pages team-a freed
                b.load_wait([Transfer("kv", first, theirs)])
                assert bool((b_pools.pages("kv", first) == 0).all())  # zeroed for another owner
                assert b.free("kv", theirs) == len(theirs)

                mine = list(a.alloc("kv", len(host)).host_pages)  # b freed them last: zeroed
                a.load_wait([Transfer("kv", back, mine)])
                assert bool((a_pools.pages("kv", back) == 0).all())
                a.write([Transfer("kv", first, mine)], allocate=False)
                assert a.free("kv", mine) == len(mine)
            finally:
                b.detach()
                a.detach()
            # The same worker's next session is another owner: what the last one freed is zeroed.
            a2 = client.attach(worker_a, a_pools.specs(), heartbeat=False)
            try:
                after = list(a2.alloc("kv", len(host)).host_pages)
                assert sorted(after) == sorted(host)
                a2.load_wait([Transfer("kv", back, after)])
                assert bool((a_pools.pages("kv", back) == 0).all())
            finally:
                a2.detach()
    finally:
        a_pools.close()
        b_pools.close()
