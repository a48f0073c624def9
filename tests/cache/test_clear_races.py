"""clear(), close() and flush() racing the index's own L3 traffic, on real pools and the real
file backend. Each race is pinned open with a gate, so the interleaving is the one named
(no sleeps): the assertion is what a worker or an operator would see afterwards."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from hicached.errors import Unavailable
from hicached.index import BackupResult, ContentIndex, IndexOptions, LookupResult, WritePolicy
from hicached.index.tenant_keys import TenantL3Keys, entry_bytes
from hicached.l2 import HostPoolGroup
from hicached.l3 import StorageBackend, create_backend

from .conftest import GatedSets, Wrapped, keys_of, write_pages


class GateAfterRead(Wrapped):
    """Once armed, ``get_into`` reads from the real backend and then waits at the gate (the
    window between an L3 read and the publish of what it read)."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.armed = False
        self.entered = threading.Event()
        self.gate = threading.Event()

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        ok = self.inner.get_into(keys, dests)
        if self.armed:
            self.entered.set()
            assert self.gate.wait(30), "test never opened the gate"
        return ok


def _in_l3(group: HostPoolGroup, path: Path, keys: list[str]) -> None:
    """An earlier daemon's life: tenant ``t``'s ``keys`` stored in the file L3 at ``path``."""
    backend = create_backend("file", {"path": str(path)})
    try:
        with ContentIndex(group, namespace="ns", backend=backend) as index:
            index.publish(keys, write_pages(group, len(keys), seed=1), tenant="t")
            assert index.flush(timeout_s=30) == len(keys)
    finally:
        backend.close()


def test_a_clear_during_a_synchronous_l3_fetch_does_not_bring_the_pages_back(
    make_group: Callable[..., HostPoolGroup], make_index: Callable[..., ContentIndex], tmp_path: Path
) -> None:
    keys = keys_of("t", 4)
    _in_l3(make_group(8), tmp_path / "l3", keys)
    backend = GateAfterRead(create_backend("file", {"path": str(tmp_path / "l3")}))
    try:
        index = make_index(make_group(8), backend, namespace="ns")
        backend.armed = True
        fetched: list[int] = []
        fetch = threading.Thread(target=lambda: fetched.append(index.fetch_into_l2(keys, tenant="t")))
        fetch.start()
        assert backend.entered.wait(30)  # the pages are read, not yet published
        assert index.clear() == (0, 4)
        backend.gate.set()
        fetch.join(30)
        assert fetched == [0]
        assert index.stats().entries == 0
        assert index.lookup(keys) == LookupResult(0, 0)
    finally:
        backend.gate.set()
        backend.inner.close()


@pytest.mark.parametrize("other", ["empty", "holding"])
def test_another_tenants_clear_during_an_l3_fetch_does_not_stop_it_publishing(
    make_group: Callable[..., HostPoolGroup],
    make_index: Callable[..., ContentIndex],
    tmp_path: Path,
    other: str,
) -> None:
    """Fails before the fix: the clear epoch was the group's, so any tenant's clear, even of a
    tenant holding nothing, made every L3 read in flight publish nothing (a worker looping
    ClearNamespace on its own empty tenant kept every other tenant's prefetches failing).
    Now a tenant's clear moves only its own epoch, and a clear that finds nothing none."""
    keys = keys_of("t", 4)
    _in_l3(make_group(8), tmp_path / "l3", keys)
    backend = GateAfterRead(create_backend("file", {"path": str(tmp_path / "l3")}))
    try:
        group = make_group(8)
        index = make_index(group, backend, namespace="ns")
        # A tenant whose epoch bucket is not t's (64 buckets under a per-index key; one in 64
        # tenants shares t's, and its clear makes t's reads miss: safe, and not this test).
        table = index._table
        tenant = next(f"u{i}" for i in range(1000) if table._bucket(f"u{i}") != table._bucket("t"))
        if other == "holding":
            index.publish(keys_of("u", 1), write_pages(group, 1, seed=2), tenant=tenant)
        backend.armed = True
        fetched: list[int] = []
        fetch = threading.Thread(target=lambda: fetched.append(index.fetch_into_l2(keys, tenant="t")))
        fetch.start()
        assert backend.entered.wait(30)  # the pages are read, not yet published
        assert index.clear(tenant)[0] == (1 if other == "holding" else 0)  # entries dropped
        backend.gate.set()
        fetch.join(30)
        assert fetched == [4]
        assert index.lookup(keys).l2_hit_pages == 4
    finally:
        backend.gate.set()
        backend.inner.close()


def test_a_tenant_cleared_while_its_evicted_pages_are_written_back_is_not_served_from_l3(
    make_group: Callable[..., HostPoolGroup], make_index: Callable[..., ContentIndex], tmp_path: Path
) -> None:
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(16)
    index = make_index(
        group, backend, write_policy=WritePolicy.WRITE_BACK, write_back_free_fraction=0.25, batch_pages=4
    )
    keys = keys_of("e", 14)
    try:
        # 14 of 16 pages used: the publish evicts ahead; the oldest go to L3 first, held.
        index.publish(keys, write_pages(group, 14, seed=13), tenant="gone")
        assert backend.entered.acquire(timeout=30)  # that write is in flight
        assert index.clear("gone")[0] == 8  # the 8 still in the table
    finally:
        backend.gate.set()
    index.flush(timeout_s=30)
    assert index.lookup(keys) == LookupResult(0, 0)
    assert backend.inner.stats().pages == 0  # what the write stored was deleted after it
    backend.inner.close()


def test_closing_while_an_eviction_holds_pages_for_their_write_frees_them(
    make_group: Callable[..., HostPoolGroup], file_backend: StorageBackend
) -> None:
    group = make_group(8)
    index = ContentIndex(
        group,
        namespace="ns",
        backend=file_backend,
        options=IndexOptions(write_policy=WritePolicy.WRITE_BACK, write_back_free_fraction=0.25),
    )
    # The window between the eviction (pages held for their write) and the write's job,
    # held open on the publishing thread at the queue (the index's own object).
    queue = index._writer.queue
    run_eviction = queue.run_eviction
    entered, gate = threading.Event(), threading.Event()

    def gated(items: Sequence[object]) -> None:
        entered.set()
        assert gate.wait(30)
        run_eviction(items)  # type: ignore[arg-type]

    queue.run_eviction = gated  # type: ignore[method-assign]
    publisher = threading.Thread(target=index.publish, args=(keys_of("k", 7), write_pages(group, 7, seed=1)))
    publisher.start()  # 7 of 8 pages used: under a quarter free, the publish evicts ahead
    assert entered.wait(30)
    index.close()
    gate.set()
    publisher.join(30)
    allocator = group.get_pool("kv").allocator
    assert allocator.available() == allocator.capacity


def test_a_write_back_flush_queues_every_unwritten_page_when_another_backup_takes_the_room(
    make_group: Callable[..., HostPoolGroup],
    make_index: Callable[..., ContentIndex],
    file_backend: StorageBackend,
) -> None:
    group = make_group(16)
    index = make_index(
        group,
        file_backend,
        write_policy=WritePolicy.WRITE_BACK,
        write_back_free_fraction=0.0,
        max_queued_pages=4,
    )
    dirty = keys_of("d", 4)
    index.publish(dirty, write_pages(group, 4, seed=1))  # the only copies, in L2
    other = keys_of("o", 4)
    index.publish(other, write_pages(group, 4, seed=2))
    # Another client's Backup takes the room right after the flush saw it free.
    queue = index._writer.queue
    wait = queue.wait_queued_at_most
    raced: list[bool] = []

    def racing_wait(pages: int, timeout_s: float | None) -> bool:
        room = wait(pages, timeout_s)
        if not raced:
            raced.append(True)
            index.backup(other)
        return room

    queue.wait_queued_at_most = racing_wait  # type: ignore[method-assign]
    assert index.flush(timeout_s=30) == 8
    assert index.stats().dropped_backup_pages == 0
    assert index.lookup(dirty) == LookupResult(4, 4)
    assert file_backend.exists(index._view.l3_keys("model-a", dirty)) == 4


def test_the_keys_remembered_for_a_tenant_clear_stay_within_their_bound(
    make_group: Callable[..., HostPoolGroup],
    make_index: Callable[..., ContentIndex],
    file_backend: StorageBackend,
) -> None:
    store = TenantL3Keys(max_bytes=6 * entry_bytes(keys_of("r0-", 1)[0], "t"))  # six keys
    group = make_group(8)
    index = make_index(group, file_backend, tenant_keys=store)
    for r in range(5):  # 20 keys written to L3, 4 at a time, L2 emptied after each round
        index.publish(keys_of(f"r{r}-", 4), write_pages(group, 4, seed=r), tenant="t")
        index.flush(timeout_s=30)
        index.reclaim("kv", 4)
    assert store.count() == 6 and store.nbytes <= store.max_bytes
    # A tenant clear removes the newest six it remembers; the older ones need a full clear.
    assert index.clear("t") == (0, 6)
    assert index.lookup(keys_of("r4-", 4)) == LookupResult(0, 0)
    assert index.lookup(keys_of("r0-", 4)) == LookupResult(0, 4)
    assert index.clear()[1] == 14


def test_a_closed_index_gives_its_remembered_keys_back(
    make_group: Callable[..., HostPoolGroup],
    make_index: Callable[..., ContentIndex],
    file_backend: StorageBackend,
) -> None:
    """The store outlives a group's index (it is the daemon's): a retired group's keys would
    otherwise hold room in it for good."""
    store = TenantL3Keys()
    group = make_group(8)
    index = make_index(group, file_backend, tenant_keys=store)
    index.publish(keys_of("c-", 4), write_pages(group, 4, seed=1), tenant="t")
    assert index.flush(timeout_s=30) == 4
    assert store.count() == 4
    index.close()
    assert (store.count(), store.nbytes) == (0, 0)


class FailingDeletes(Wrapped):
    """``delete`` raises Unavailable (a store restarting) while ``failing`` is set."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.failing = False

    def delete(self, keys: Sequence[str]) -> int:
        if self.failing:
            raise Unavailable("the store is restarting")
        return self.inner.delete(keys)


def test_a_tenant_clear_whose_l3_delete_failed_can_be_retried(
    make_group: Callable[..., HostPoolGroup], make_index: Callable[..., ContentIndex], tmp_path: Path
) -> None:
    """Before: the tenant's L3 keys were forgotten before the delete ran, so after a failed
    delete a retried clear deleted nothing and the pages were still served from L3."""
    backend = FailingDeletes(create_backend("file", {"path": str(tmp_path / "l3")}))
    try:
        group = make_group(8)
        index = make_index(group, backend)
        keys = keys_of("t", 4)
        index.publish(keys, write_pages(group, 4, seed=3), tenant="t")
        index.flush(timeout_s=30)
        backend.failing = True
        with pytest.raises(Unavailable):
            index.clear("t")
        backend.failing = False
        assert index.clear("t") == (0, 4)
        assert index.lookup(keys) == LookupResult(0, 0)
    finally:
        backend.inner.close()


class FetchBeforeClear(Wrapped):
    """Once armed, ``clear`` first runs ``fetch`` (a GetPages with include_l3 that reads L3
    after the clear dropped L2 but before L3 is deleted), then clears."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.fetch: Callable[[], int] | None = None
        self.fetched: list[int] = []

    def clear(self, prefix: str = "") -> int:
        fetch, self.fetch = self.fetch, None
        if fetch is not None:
            self.fetched.append(fetch())
        return self.inner.clear(prefix)


def test_an_l3_read_between_a_clears_l2_drop_and_its_l3_delete_publishes_nothing(
    make_group: Callable[..., HostPoolGroup], make_index: Callable[..., ContentIndex], tmp_path: Path
) -> None:
    """Fails before the fix: the read took the clear epoch after the clear moved it, so what it
    read from L3 (just before the delete) was published, and the cleared keys were still in L2
    once the clear returned."""
    keys = keys_of("t", 4)
    _in_l3(make_group(8), tmp_path / "l3", keys)
    backend = FetchBeforeClear(create_backend("file", {"path": str(tmp_path / "l3")}))
    try:
        index = make_index(make_group(8), backend, namespace="ns")
        backend.fetch = lambda: index.fetch_into_l2(keys, tenant="t")
        assert index.clear() == (0, 4)
        assert backend.fetched == [0]
        assert index.stats().entries == 0
        assert index.lookup(keys) == LookupResult(0, 0)
    finally:
        backend.inner.close()


class PublishBeforeClear(Wrapped):
    """Once armed, ``clear`` first runs ``publish`` (a key published, and written to L3, after
    the clear dropped L2 but before L3 is deleted), then clears."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.publish: Callable[[], object] | None = None

    def clear(self, prefix: str = "") -> int:
        publish, self.publish = self.publish, None
        if publish is not None:
            publish()
        return self.inner.clear(prefix)


def test_a_backup_written_before_a_clears_l3_delete_is_not_counted_as_in_l3(
    make_group: Callable[..., HostPoolGroup], make_index: Callable[..., ContentIndex], tmp_path: Path
) -> None:
    """Fails before the fix: the entry was marked in L3, the clear then deleted its object; the
    index counted it in L3 (an eviction freed it without a write, a Backup skipped it)."""
    backend = PublishBeforeClear(create_backend("file", {"path": str(tmp_path / "l3")}))
    try:
        group = make_group(8)
        index = make_index(group, backend)
        keys = keys_of("n", 2)

        def publish() -> None:
            index.publish(keys, write_pages(group, 2, seed=4))
            index.backup(keys, wait=True, timeout_s=30)  # written, before the delete

        backend.publish = publish
        assert index.clear() == (0, 2)  # the full clear deleted what was just written
        # No backup queued any more (a flush would write the two again: L3 lacks them).
        assert index._writer.queue.wait_queued_at_most(0, 30)
        assert index.lookup(keys) == LookupResult(2, 2)  # still in L2, not in L3
        assert index.stats().l3_resident_entries == 0
        assert index.backup(keys, wait=True, timeout_s=30) == BackupResult(2, 2)  # written again
        assert index.stats().l3_resident_entries == 2
    finally:
        backend.inner.close()
