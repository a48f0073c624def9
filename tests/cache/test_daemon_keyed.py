"""Issue 4 items 3-4 over the wire: a real daemon (``python -m hicached serve``) with the
file backend; workers are client sessions with their own shared-memory "device" pools."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hicached_client import HiCacheClient, HiCacheError, PrefetchState, TokenChain, WorkerIdentity

from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import PAGE_SIZE, POOLS, WorkerPools, transfers, unique_tag

MODEL = "m-keyed"
PAGES = 64


@pytest.fixture(scope="module")
def l3_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    path = tmp_path_factory.mktemp("keyed-l3")
    d = start_daemon("--l3", "file", "--l3-path", str(path / "l3"))
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def client(l3_daemon: Daemon) -> Iterator[HiCacheClient]:
    with HiCacheClient(l3_daemon.target, timeout_s=30.0) as c:
        yield c


def new_worker(made: list[WorkerPools], seed: int | None) -> tuple[str, WorkerPools]:
    tag = unique_tag("kw")
    pools = WorkerPools.create(tag)
    made.append(pools)
    if seed is None:
        pools.clobber()
    else:
        pools.fill_random(seed)
    return tag, pools


def chain(n_pages: int, salt: str, offset: int = 0) -> TokenChain:
    return TokenChain(token_ids=list(range(offset, offset + n_pages * PAGE_SIZE)), cache_salt=salt)


def test_worker_b_loads_worker_a_prefix_without_recomputing(
    client: HiCacheClient, worker_pools: list[WorkerPools]
) -> None:
    tag_a, pools_a = new_worker(worker_pools, seed=21)
    tag_b, pools_b = new_worker(worker_pools, seed=None)
    src, dst = list(range(PAGES)), list(range(500, 500 + PAGES))
    keys = chain(PAGES, "tenant-1")
    with (
        client.attach(WorkerIdentity(tag_a, generation=1, model_name=MODEL), pools_a.specs()) as a,
        client.attach(WorkerIdentity(tag_b, generation=1, model_name=MODEL), pools_b.specs()) as b,
    ):
        put = a.put_pages(keys, transfers(src))
        assert (put.ok, put.stored_pages, put.existing_pages) == (True, PAGES, 0)

        seen = b.lookup(keys)
        assert (seen.l2_hit_pages, seen.total_hit_pages) == (PAGES, PAGES)
        # Same tokens, another tenant: never a match.
        other = b.lookup(chain(PAGES, "tenant-2"))
        assert (other.l2_hit_pages, other.total_hit_pages) == (0, 0)

        got = b.get_pages(keys, transfers(dst))
        assert got.hit_pages == PAGES
        for pool in POOLS:
            assert pools_b.digest(pool, dst) == pools_a.digest(pool, src), pool

        # B computing the same prefix stores nothing new.
        again = b.put_pages(keys, transfers(dst))
        assert (again.stored_pages, again.existing_pages) == (0, PAGES)


def test_prefetch_brings_evicted_pages_back_from_l3_for_another_worker(
    client: HiCacheClient, worker_pools: list[WorkerPools]
) -> None:
    tag_a, pools_a = new_worker(worker_pools, seed=22)
    tag_b, pools_b = new_worker(worker_pools, seed=None)
    src, dst = list(range(600, 600 + PAGES)), list(range(300, 300 + PAGES))
    keys = chain(PAGES, "tenant-p", offset=7)
    model = f"{MODEL}-prefetch"
    with client.attach(WorkerIdentity(tag_a, generation=1, model_name=model), pools_a.specs()) as a:
        # The host pools hold 1024 pages: four 256-page fillers must evict our 64.
        assert a.info.pool("kv").total_pages == 1024
        assert a.put_pages(keys, transfers(src)).stored_pages == PAGES
        backed = a.backup(keys, wait=True)
        assert backed.stored_pages == backed.queued_pages  # write_through may have stored them already
        # Fill the host pools with other prefixes: the oldest entries (ours) are evicted.
        for i in range(4):
            filler = chain(256, "tenant-filler", offset=100_000 * (i + 1))
            assert a.put_pages(filler, transfers(list(range(256)))).ok
            a.backup(filler, wait=True)
        seen = a.lookup(keys)
        assert (seen.l2_hit_pages, seen.total_hit_pages) == (0, PAGES)
    with client.attach(WorkerIdentity(tag_b, generation=1, model_name=model), pools_b.specs()) as b:
        ticket = b.prefetch(keys, policy="wait_complete")
        assert ticket.planned_pages == PAGES
        status = b.prefetch_status(ticket.prefetch_id, wait=True)
        assert (status.state, status.completed_pages) == (PrefetchState.DONE, PAGES)
        assert b.lookup(keys).l2_hit_pages == PAGES
        got = b.get_pages(keys, transfers(dst))
        assert got.hit_pages == PAGES
        for pool in POOLS:
            assert pools_b.digest(pool, dst) == pools_a.digest(pool, src), pool


def test_a_per_key_lookup_answers_every_key_in_l2_and_l3(
    client: HiCacheClient, worker_pools: list[WorkerPools]
) -> None:
    """``lookup(per_key=True)`` answers each key, also after a miss, from L2 and from L3; the
    leading runs agree with a plain lookup; another tenant's session sees none of them."""
    tag_a, pools_a = new_worker(worker_pools, seed=23)
    tag_b, pools_b = new_worker(worker_pools, seed=None)
    model = f"{MODEL}-per-key"
    old_chain, new_chain = chain(2, "tenant-k", offset=11), chain(2, "tenant-k", offset=900_011)
    with client.attach(WorkerIdentity(tag_a, generation=1, model_name=model), pools_a.specs()) as a:
        old = list(a.lookup(old_chain).keys)
        assert a.put_pages(old, transfers([1, 2])).stored_pages == 2
        assert a.backup(old, wait=True).stored_pages >= 0
        for i in range(4):  # evict the old pages from L2 (1,024 host pages); L3 keeps them
            filler = chain(256, "tenant-filler", offset=200_000 * (i + 1))
            assert a.put_pages(filler, transfers(list(range(256)))).ok
            a.backup(filler, wait=True)
        new = list(a.lookup(new_chain).keys)
        assert a.put_pages(new, transfers([3, 4])).stored_pages == 2
        missing = "f" * 64
        asked = [new[0], missing, old[0], new[1], old[1]]
        plain = a.lookup(asked)
        each = a.lookup(asked, per_key=True)
        assert each.in_l2 == (True, False, False, True, False)
        assert each.cached == (True, False, True, True, True)
        assert (
            (each.l2_hit_pages, each.total_hit_pages) == (plain.l2_hit_pages, plain.total_hit_pages) == (1, 1)
        )
        assert (plain.in_l2, plain.cached) == ((), ())
        assert a.lookup([], per_key=True).cached == ()
    other = WorkerIdentity(tag_b, generation=1, model_name=model, tenant="tenant-other")
    with client.attach(other, pools_b.specs()) as b:
        assert b.lookup(asked, per_key=True).cached == (False,) * 5


def test_clear_namespace_of_one_tenant_drops_its_l2_and_l3_pages_only(
    l3_daemon: Daemon, client: HiCacheClient, worker_pools: list[WorkerPools]
) -> None:
    tag_g, pools_g = new_worker(worker_pools, seed=23)
    tag_k, pools_k = new_worker(worker_pools, seed=24)
    model = f"{MODEL}-clear"
    gone, kept = chain(16, "tenant-gone", offset=3), chain(16, "tenant-kept", offset=3)
    with (
        client.attach(
            WorkerIdentity(tag_g, generation=1, model_name=model, tenant="tenant-gone"), pools_g.specs()
        ) as g,
        client.attach(
            WorkerIdentity(tag_k, generation=1, model_name=model, tenant="tenant-kept"), pools_k.specs()
        ) as k,
    ):
        for s, keys in ((g, gone), (k, kept)):
            assert s.put_pages(keys, transfers(list(range(16)))).stored_pages == 16
            backed = s.backup(keys, wait=True)
            assert backed.stored_pages == backed.queued_pages
            assert s.lookup(keys).total_hit_pages == 16
        with HiCacheClient(l3_daemon.admin_target, timeout_s=30.0) as admin:
            cleared = admin.clear_namespace(model, "tenant-gone")
        assert (cleared.l2_pages, cleared.l3_pages) == (16, 16)
        after = g.lookup(gone)
        assert (after.l2_hit_pages, after.total_hit_pages) == (0, 0)
        still = k.lookup(kept)
        assert (still.l2_hit_pages, still.total_hit_pages) == (16, 16)


def test_a_prefetch_retried_with_its_op_id_starts_no_second_one(
    client: HiCacheClient, worker_pools: list[WorkerPools]
) -> None:
    """Fails before (a review of stop 45): Prefetch ignored its op_id, so a retry of a call
    whose answer was lost started a second prefetch, orphaning the first's id and taking
    another of the session's ``limits.max_prefetches_per_session`` slots."""
    tag, pools = new_worker(worker_pools, seed=23)
    keys = chain(4, "tenant-retry", offset=3)
    with client.attach(WorkerIdentity(tag, generation=1, model_name=f"{MODEL}-retry"), pools.specs()) as s:
        first = s.prefetch(keys, policy="best_effort", op_id="prefetch-op-1")
        again = s.prefetch(keys, policy="best_effort", op_id="prefetch-op-1")
        assert again == first
        other = s.prefetch(keys, policy="best_effort", op_id="prefetch-op-2")
        assert other.prefetch_id != first.prefetch_id
        with pytest.raises(HiCacheError) as err:  # the same op id for another call
            s.prefetch(chain(4, "tenant-retry", offset=9), policy="best_effort", op_id="prefetch-op-1")
        assert err.value.code.name == "INVALID_ARGUMENT" and "already used" in err.value.message, err.value


def test_another_sessions_prefetch_reads_as_unknown_and_is_untouched(
    client: HiCacheClient, worker_pools: list[WorkerPools]
) -> None:
    """PrefetchStatus and CancelPrefetch of another session's prefetch answer NOT_FOUND in the
    words of an unknown id (they were PERMISSION_DENIED: a stranger holding a leaked id
    learned that it exists), and the owner's prefetch goes on as before."""
    tag_a, pools_a = new_worker(worker_pools, seed=24)
    tag_b, pools_b = new_worker(worker_pools, seed=None)
    model = f"{MODEL}-strangers"
    with (
        client.attach(WorkerIdentity(tag_a, generation=1, model_name=model), pools_a.specs()) as a,
        client.attach(WorkerIdentity(tag_b, generation=1, model_name=model), pools_b.specs()) as b,
    ):
        ticket = a.prefetch(chain(4, "tenant-strangers", offset=5), policy="best_effort")
        no_such_id = "0" * len(ticket.prefetch_id)
        for name, call in {"PrefetchStatus": b.prefetch_status, "CancelPrefetch": b.cancel_prefetch}.items():
            with pytest.raises(HiCacheError) as theirs:
                call(ticket.prefetch_id)
            with pytest.raises(HiCacheError) as unknown:
                call(no_such_id)
            assert theirs.value.code.name == unknown.value.code.name == "NOT_FOUND", (name, theirs.value)
            assert theirs.value.message.replace(ticket.prefetch_id, no_such_id) == unknown.value.message, name
        status = a.prefetch_status(ticket.prefetch_id, wait=True)
        assert status.state == PrefetchState.DONE, status
