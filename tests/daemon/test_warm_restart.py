"""Warm restart: with ``host.warm_restart`` a cleanly stopped daemon leaves its host pools in
/dev/shm plus a journal of its content index, and the next daemon with the same prefix re-maps
them, so L2 hits survive the restart. A crash (no journal) or a journal that does not match the
attach falls back to a cold group, leaving no stale segment. ``--l3 none``: hits can only come
from L2.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hicached_client import HiCacheClient, TokenChain, WorkerIdentity

from hicached.core.group_state import GroupState
from hicached.core.journal import TENANT_BYTES, GroupJournal, JournalStore, PoolRecord
from hicached.errors import FailedPrecondition, InvalidArgument, Unavailable
from hicached.index import ContentIndex
from hicached.index.entries import EntryRecord
from hicached.l2 import HostLayout, HostPoolGroup, KVSpec, PoolEntry, PoolKind, create_host_pool
from hicached.server.rpc_sessions import MAX_TENANT_BYTES
from hicached.testing.servers import redis_server
from tests.daemon.conftest import stop_with
from tests.support.daemon import Daemon
from tests.support.kv import PAGE_SIZE, POOLS, WorkerPools, transfers, unique_tag
from tests.support.state import poll
from tests.support.warm import Warm

MODEL = "m-warm"
N = 48  # keys put before the restart
TIMEOUT_S = 30.0


@pytest.fixture
def pools() -> Iterator[WorkerPools]:
    p = WorkerPools.create(unique_tag("warm"))
    try:
        yield p
    finally:
        p.close()


def put_keys(daemon: Daemon, pools: WorkerPools, ident: WorkerIdentity, chain: TokenChain) -> None:
    with HiCacheClient(daemon.target, timeout_s=TIMEOUT_S) as client:
        session = client.attach(ident, pools.specs(), heartbeat=False)
        assert not session.info.joined_existing_group
        put = session.put_pages(chain, transfers(range(N)))
        assert (put.ok, put.stored_pages) == (True, N)
        assert session.lookup(chain).l2_hit_pages == N
        session.detach()


def chain_of(tag: str) -> TokenChain:
    return TokenChain(list(range(N * PAGE_SIZE)), cache_salt=f"tenant-{tag}")


def test_clean_restart_keeps_published_pages(warm: Warm, pools: WorkerPools) -> None:
    pools.fill_random(23)
    expected = {name: pools.pages(name, range(N)) for name in POOLS}
    ident = WorkerIdentity(unique_tag("w"), generation=1, model_name=MODEL)
    chain = chain_of("clean")

    first = warm.start()
    put_keys(first, pools, ident, chain)
    assert stop_with(first, signal.SIGTERM) == 0, first.log
    kept = warm.segments()
    assert len(kept) == len(POOLS), f"host pools not kept: {kept}"
    (journal,) = warm.journals()
    # It lists tenants and keys: only the daemon's user reads it (was 0644 in a 0755 directory).
    assert (mode(journal), mode(warm.journal_dir)) == (0o600, 0o700)
    data = json.loads(journal.read_text())
    assert len(data["entries"]["keys"]) == N
    assert {p["segment"] for p in data["pools"]} == kept

    pools.clobber()
    second = warm.start()
    try:
        assert warm.journals() == [journal], "a journal is consumed by its group's first attach"
        with HiCacheClient(second.target, timeout_s=TIMEOUT_S) as client:
            session = client.attach(ident, pools.specs(), heartbeat=False)
            info = session.info
            assert info.joined_existing_group, second.log
            assert not warm.journals(), "the journal must be consumed when the group is re-mapped"
            assert {p.segment for p in info.pools} == kept
            for p in info.pools:
                assert p.free_pages == p.total_pages - N, (p.name, p.free_pages, p.total_pages)
            found = session.lookup(chain)
            assert (found.l2_hit_pages, found.total_hit_pages) == (N, N)
            got = session.get_pages(chain, transfers(range(N)))
            assert got.hit_pages == N
            for name in POOLS:
                assert torch.equal(pools.pages(name, range(N)), expected[name]), f"pool {name} differs"
            session.detach()
        assert stop_with(second, signal.SIGTERM) == 0, second.log
        (again,) = warm.journals()
        assert len(json.loads(again.read_text())["entries"]["keys"]) == N
        assert warm.segments() == kept
    finally:
        second.stop()


def test_crash_leaves_no_journal_and_restarts_cold(warm: Warm, pools: WorkerPools) -> None:
    pools.fill_random(29)
    ident = WorkerIdentity(unique_tag("w"), generation=1, model_name=MODEL)
    chain = chain_of("crash")

    first = warm.start()
    put_keys(first, pools, ident, chain)
    stop_with(first, signal.SIGKILL)
    stale = warm.segments()
    assert len(stale) == len(POOLS)
    assert not warm.journals(), "a crash must not leave a journal"

    second = warm.start()
    try:
        assert not warm.segments(), "a crashed daemon's segments must be removed at startup"
        assert "left without a journal" in second.log
        with HiCacheClient(second.target, timeout_s=TIMEOUT_S) as client:
            session = client.attach(ident, pools.specs(), heartbeat=False)
            info = session.info
            assert not info.joined_existing_group
            assert warm.segments() == {p.segment for p in info.pools}, "a stale segment was left"
            for p in info.pools:
                assert p.free_pages == p.total_pages, (p.name, p.free_pages)
            found = session.lookup(chain)
            assert (found.l2_hit_pages, found.total_hit_pages) == (0, 0)
            session.detach()
        assert stop_with(second, signal.SIGTERM) == 0, second.log
        # Nothing leaked: the cold group journals empty, with exactly its own segments.
        (journal,) = warm.journals()
        data = json.loads(journal.read_text())
        assert data["entries"]["keys"] == []
        assert {p["segment"] for p in data["pools"]} == warm.segments()
    finally:
        second.stop()


def test_a_daemon_leaves_the_segments_of_a_prefix_that_extends_its_own(
    warm: Warm, pools: WorkerPools, tmp_path: Path
) -> None:
    """Fails before: a daemon of prefix ``p`` took the segments a cleanly stopped
    ``p-<16 hex>`` daemon kept for its warm restart (``p-<16 hex>-<group id>-<pool>``) for its
    own crashed ones (``p-<group id>-<pool>``) and removed them at its start: that daemon's
    next start was cold."""
    longer = Warm(prefix=f"{warm.prefix}-0123456789abcdef", journal_dir=tmp_path / "longer")
    ident = WorkerIdentity(unique_tag("w"), generation=1, model_name=MODEL)
    chain = chain_of("x")
    other = longer.start()
    try:
        put_keys(other, pools, ident, chain)
    finally:
        assert stop_with(other, signal.SIGTERM) == 0, other.log
    kept = longer.segments()
    assert len(kept) == len(POOLS) and len(longer.journals()) == 1
    mine = warm.start()
    try:
        assert longer.segments() == kept, mine.log
        assert "left without a journal" not in mine.log
    finally:
        assert stop_with(mine, signal.SIGTERM) == 0, mine.log
    again = longer.start()
    try:
        with HiCacheClient(again.target, timeout_s=TIMEOUT_S) as client:
            session = client.attach(ident, pools.specs(), heartbeat=False)
            assert session.info.joined_existing_group  # warm: its pages were kept
            assert session.lookup(chain).l2_hit_pages == N
            session.detach()
    finally:
        again.stop()


def test_journal_of_another_pool_shape_starts_cold(warm: Warm, pools: WorkerPools) -> None:
    pools.fill_random(31)
    ident = WorkerIdentity(unique_tag("w"), generation=1, model_name=MODEL)
    chain = chain_of("shape")

    first = warm.start()
    put_keys(first, pools, ident, chain)
    assert stop_with(first, signal.SIGTERM) == 0, first.log
    assert len(warm.journals()) == 1

    second = warm.start()
    try:
        with HiCacheClient(second.target, timeout_s=TIMEOUT_S) as client:
            # Same group (the host size is not part of its key), half the host pages.
            session = client.attach(ident, pools.specs(host_ratio=0.5), heartbeat=False)
            info = session.info
            assert not info.joined_existing_group
            assert "do not match" in second.log
            assert not warm.journals(), "a mismatching journal must be removed"
            assert warm.segments() == {p.segment for p in info.pools}
            for p in info.pools:
                assert p.free_pages == p.total_pages
            assert session.lookup(chain).total_hit_pages == 0
            session.detach()
    finally:
        second.stop()


# ---------------------------------------------------------------- in-process parts


@pytest.fixture
def group() -> Iterator[HostPoolGroup]:
    """A real two-pool group (anchor ``kv``, sidecar ``draft``) in test-only segments."""
    spec = KVSpec(PoolKind.MHA, torch.float16, 2, 2, 4, PAGE_SIZE)
    made = [
        create_host_pool(spec, layout, 16, segment_name=f"hcwr-unit-{unique_tag(name)}", pin=False)
        for name, layout in (("kv", HostLayout.PAGE_FIRST), ("draft", HostLayout.LAYER_FIRST))
    ]
    try:
        yield HostPoolGroup(
            [PoolEntry("kv", made[0], is_primary_index_anchor=True), PoolEntry("draft", made[1])]
        )
    finally:
        for pool in made:
            pool.close()
            pool.unlink()


def allocated(group: HostPoolGroup) -> dict[str, int]:
    return {e.name: e.host_pool.allocator.allocated_count() for e in group.entries}


def publish(index: ContentIndex, group: HostPoolGroup, keys: list[str], tenant: str) -> None:
    pages = {e.name: e.host_pool.allocator.alloc(len(keys)) for e in group.entries}
    assert index.publish(keys, pages, tenant=tenant).all()


def test_export_and_restore_keep_pages_lru_order_and_flags(group: HostPoolGroup) -> None:
    first = ContentIndex(group, namespace="m", backend=None)
    keys = [f"k{i}" for i in range(5)]
    publish(first, group, keys, "t1")
    first.unpin(first.pin(["k4"]))  # k4 becomes the most recently used
    owned = first.owned_pages()
    records = first.export_entries()
    late = {e.name: e.host_pool.allocator.alloc(1) for e in group.entries}
    with pytest.raises(Unavailable):  # frozen: nothing changes after the snapshot
        first.publish(["late"], late)
    for name, page in late.items():
        group.get_pool(name).allocator.free(page)
    first.close()
    assert allocated(group) == {"kv": 0, "draft": 0}
    assert [r.key for r in records][-1] == "k4"
    assert {r.tenant for r in records} == {"t1"}

    second = ContentIndex(group, namespace="m", backend=None)
    try:
        assert second.restore(records) == 5
        assert allocated(group) == {"kv": 5, "draft": 5}
        got = second.owned_pages()
        assert all(np.array_equal(got[name], owned[name]) for name in ("kv", "draft"))
        assert second.lookup(keys).l2_hit_pages == 5
        with pytest.raises(FailedPrecondition):  # only into an empty index
            second.restore(records)
        assert second.reclaim("kv", 1) == 1  # the least recently used entry leaves first
        assert second.lookup(["k4"]).l2_hit_pages == 1
        assert [r.key for r in second.export_entries()] == [r.key for r in records[1:]]
    finally:
        second.close()
    assert allocated(group) == {"kv": 0, "draft": 0}


def test_a_journaled_group_hands_out_no_page_after_its_snapshot(group: HostPoolGroup) -> None:
    """Fails before: the index's close (after the journal was taken) freed the pages the
    journal lists, and the group still allocated them: a call still running at shutdown could
    get one and write into it, and the next daemon would serve those bytes under the key.
    A clear after the snapshot was done, and the next daemon brought its entries back."""
    state = GroupState("g", "m", group, nbytes=0, index=ContentIndex(group, namespace="m", backend=None))
    assert state.index is not None
    publish(state.index, group, [f"k{i}" for i in range(4)], "t")
    listed = {p.pages["kv"] for p in state.journal().entries}
    with pytest.raises(Unavailable, match="journaled"):
        state.index.clear("t")
    state.index.close()  # frees every page the index held
    refused = group.allocate({"kv": 1, "draft": 1})
    assert (refused.ok, refused.reason) == (
        False,
        "the pool group is closing (shutdown): it allocates no more",
    )
    assert group.alloc(1) is None, listed
    assert allocated(group) == {"kv": 0, "draft": 0}  # frees are still taken


def test_a_sealed_group_evicts_nothing_for_an_allocation(group: HostPoolGroup) -> None:
    """Fails on the first cut of the seal (``available`` 0 once sealed): an allocation between
    the seal and the index's freeze asked the index to evict for it, and the entries it
    evicted were missing from the journal."""
    index = ContentIndex(group, namespace="m", backend=None)
    try:
        publish(index, group, [f"k{i}" for i in range(4)], "t")
        group.seal()
        assert group.allocate({"kv": 1, "draft": 1}).ok is False
        assert index.lookup([f"k{i}" for i in range(4)]).l2_hit_pages == 4
    finally:
        index.close()


@pytest.mark.parametrize(
    ("pages", "error"),
    [
        ({"kv": [16, 1], "draft": [0, 1]}, InvalidArgument),  # out of range
        ({"kv": [3, 3], "draft": [0, 1]}, InvalidArgument),  # listed twice
        ({"kv": [0, 1]}, InvalidArgument),  # a pool is missing
        ({"kv": [0, 1], "draft": [0, 1], "x": [0, 1]}, InvalidArgument),  # an unknown pool
        ({"kv": [0, 1], "draft": [5, 1]}, FailedPrecondition),  # draft page 5 is taken
    ],
)
def test_restore_refuses_bad_records_and_changes_nothing(
    group: HostPoolGroup, pages: dict[str, list[int]], error: type[Exception]
) -> None:
    group.get_pool("draft").allocator.mark_allocated([5])
    records = [EntryRecord(f"k{i}", {name: col[i] for name, col in pages.items()}) for i in range(2)]
    index = ContentIndex(group, namespace="m", backend=None)
    try:
        with pytest.raises(error):
            index.restore(records)
        assert allocated(group) == {"kv": 0, "draft": 1}
        assert index.stats().entries == 0
    finally:
        index.close()
        group.get_pool("draft").allocator.free([5])


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_journal_store_round_trip_and_refusals(tmp_path: Path) -> None:
    prefix = f"hcwr-unit{uuid.uuid4().hex[:8]}"  # its lock in /dev/shm is host-wide
    store = JournalStore(tmp_path / "j", prefix, max_key_bytes=512)
    old = os.umask(0o002)  # the most a umask usually allows: 0664 files, 0775 directories
    try:
        store.lock()
    finally:
        os.umask(old)
    try:
        assert mode(tmp_path / "j") == 0o700
        with pytest.raises(FailedPrecondition, match="another daemon"):
            JournalStore(tmp_path / "j", prefix, max_key_bytes=512).lock()
        journal = GroupJournal(
            "g1",
            (PoolRecord("kv", 16, "seg-kv", "0" * 32),),
            (EntryRecord("a", {"kv": 3}, "t", True), EntryRecord("b", {"kv": 0})),
        )
        assert store.read("g1", [16]) is None
        path = store.write(journal)
        assert mode(path) == 0o600, "a journal lists tenants and keys: the daemon's user only"
        assert store.read("g1", [16]) == journal
        assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
        data = json.loads(path.read_text())
        data["version"] = 99
        path.write_text(json.dumps(data))
        with pytest.raises(FailedPrecondition, match="v99"):
            store.read("g1", [16])
        path.write_text("{not json")
        with pytest.raises(FailedPrecondition, match="not JSON"):
            store.read("g1", [16])
        store.write(journal)
        path.rename(store.path("g2"))
        with pytest.raises(FailedPrecondition, match="belongs to group"):
            store.read("g2", [16])
        store.remove("g2")
        store.remove("g2")  # idempotent
        assert store.read("g2", [16]) is None
    finally:
        store.unlock()
    again = JournalStore(tmp_path / "j", prefix, max_key_bytes=512)
    again.lock()  # released: the next daemon may take it
    again.unlock()  # (and must give it back: the prefix's lock in /dev/shm is one for every journal_dir)
    (tmp_path / "old").mkdir(mode=0o755)  # made by an earlier version
    older = JournalStore(tmp_path / "old", prefix, max_key_bytes=512)
    older.lock()
    older.unlock()
    assert mode(tmp_path / "old") == 0o700


def test_the_lock_removes_the_journal_writes_a_killed_daemon_left(tmp_path: Path) -> None:
    """Fails before: a daemon SIGKILLed while it wrote its journals (the end of a shutdown's
    grace period) left each temporary file, as large as a journal, and the next daemons kept
    them: one more per kill. Another prefix's, even one that extends this one, stay."""
    prefix = f"hcwr-unit{uuid.uuid4().hex[:8]}"
    directory = tmp_path / "j"
    directory.mkdir(mode=0o700)
    gid = "0123456789abcdef"
    stale = [directory / f".{prefix}-{gid}.json.{pid}.tmp" for pid in (1, 4242)]
    kept = [
        directory / f".{prefix}-{gid}-fedcba9876543210.json.7.tmp",  # prefix "<prefix>-<gid>"
        directory / f".other-{gid}.json.7.tmp",
        directory / f"{prefix}-{gid}.json",  # a journal
    ]
    for path in (*stale, *kept):
        path.write_bytes(b"x" * 1024)
    store = JournalStore(directory, prefix, max_key_bytes=512)
    store.lock()
    try:
        assert sorted(p.name for p in directory.iterdir()) == sorted(
            [*(p.name for p in kept), f"{prefix}.lock"]
        )
    finally:
        store.unlock()


def test_every_journal_is_written_before_a_stalled_l3_holds_the_shutdown(
    warm: Warm, pools: WorkerPools
) -> None:
    """Two pool groups, and a redis-server L3 that stops answering (SIGSTOP) while their
    backups are in flight. Closing a group's index waits for its L3 thread, which waits out the
    10 s socket timeout. Before, the first group's close came before the second group's
    journal, so that journal waited too (past a pod's grace period, the SIGKILL loses it); now
    every journal is written first."""
    with redis_server() as redis:
        daemon = warm.start_with(
            "--l3", "redis",
            "--set", f"l3.redis.host={redis.host}",
            "--set", f"l3.redis.port={redis.port}",
            "--set", "l3.redis.socket_timeout_s=10",
            "--set", "l3.write_policy=write_back",
            "--set", "server.grace_s=1",
        )  # fmt: skip
        stopped = False
        try:
            with HiCacheClient(daemon.target, timeout_s=TIMEOUT_S) as client:
                sessions = [
                    client.attach(
                        WorkerIdentity(unique_tag("w"), generation=1, model_name=f"{MODEL}-{g}"),
                        pools.specs(),
                        heartbeat=False,
                    )
                    for g in range(2)
                ]
                os.killpg(os.getpgid(redis.pid), signal.SIGSTOP)
                stopped = True
                for g, session in enumerate(sessions):
                    put = session.put_pages(chain_of(f"stall-{g}"), transfers(range(N)))
                    assert put.stored_pages == N
                    session.detach()
            daemon.process.send_signal(signal.SIGTERM)
            try:
                poll(warm.journals, lambda j: len(j) == 2, 5.0, "both journals while the L3 is stalled")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{daemon.log}") from None
        finally:
            if stopped:
                os.killpg(os.getpgid(redis.pid), signal.SIGCONT)
            code = daemon.process.wait(timeout=TIMEOUT_S)
            daemon.stop()
    assert code == 0, daemon.log
    assert len(warm.journals()) == 2


def test_a_journal_is_never_written_past_its_bound(tmp_path: Path) -> None:
    """A journal whose entries are longer than its group can legitimately hold (keys over
    limits.max_key_bytes, here 8) is not written: the next daemon would refuse it. Before, any
    journal was written, however large."""
    prefix = f"hcwr-unit{uuid.uuid4().hex[:8]}"
    store = JournalStore(tmp_path / "j", prefix, max_key_bytes=8)
    store.lock()
    try:
        pools = (PoolRecord("kv", 2, "seg-kv", "0" * 32),)
        fits = GroupJournal("g1", pools, (EntryRecord("k" * 8, {"kv": 0}, "t" * TENANT_BYTES),))
        assert store.read("g1", [2]) is None
        store.write(fits)
        assert store.read("g1", [2]) == fits
        store.remove("g1")
        over = GroupJournal(
            "g1", pools, tuple(EntryRecord("\0" * 4096 + str(i), {"kv": i}) for i in range(2))
        )
        with pytest.raises(FailedPrecondition, match="over its bound of"):
            store.write(over)
        assert list((tmp_path / "j").glob("*.json")) == []
        assert [p.name for p in (tmp_path / "j").iterdir() if p.name.endswith(".tmp")] == []
    finally:
        store.unlock()


def test_the_bound_counts_the_longest_tenant() -> None:
    assert TENANT_BYTES == MAX_TENANT_BYTES


def test_a_journal_left_in_another_journal_dir_is_not_replayed_onto_newer_segments(
    warm: Warm, pools: WorkerPools, tmp_path: Path
) -> None:
    """Fails before (a review of stop 46): daemon 1 (journal dir J1) stops cleanly, keeping its
    segments and J1's journal; daemon 2 of the same prefix with journal dir J2 finds the
    segments without a journal, re-creates them under the same names and fills them with
    other pages; daemon 3, on J1 again, replayed J1's journal onto daemon 2's segments and
    served daemon 2's bytes under daemon 1's keys. A journal names the incarnation of each
    segment it describes now; another one starts the group cold."""
    other = Warm(warm.prefix, tmp_path / "journal-2")
    ident = WorkerIdentity(unique_tag("w"), generation=1, model_name=MODEL)
    first_chain, second_chain = chain_of("first"), chain_of("second")
    pools.fill_random(31)
    first = warm.start()
    put_keys(first, pools, ident, first_chain)
    assert stop_with(first, signal.SIGTERM) == 0, first.log
    (left_behind,) = warm.journals()

    pools.fill_random(32)  # daemon 2's pages hold other bytes
    second = other.start()
    put_keys(second, pools, ident, second_chain)
    assert stop_with(second, signal.SIGTERM) == 0, second.log
    assert warm.journals() == [left_behind]

    third = warm.start()
    try:
        with HiCacheClient(third.target, timeout_s=TIMEOUT_S) as client:
            pools.clobber()
            session = client.attach(ident, pools.specs(), heartbeat=False)
            assert not session.info.joined_existing_group, third.log
            found = session.lookup(first_chain)
            assert (found.l2_hit_pages, found.total_hit_pages) == (0, 0), "a cold group holds nothing"
            for name in POOLS:
                assert pools.untouched(name, excluding=[]), f"pool {name} was written"
            session.detach()
        assert "re-created since the warm-restart journal" in third.log
    finally:
        third.stop()
