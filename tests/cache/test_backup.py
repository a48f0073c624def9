"""L2 -> L3 backup: write policies, the first failed batch stops a job, never blocking."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from hicached.errors import FailedPrecondition, ResourceExhausted, Unavailable
from hicached.index import BackupResult, ContentIndex, LookupResult, WritePolicy
from hicached.index.entries import Entry
from hicached.l2 import HostPoolGroup
from hicached.l3 import StorageBackend, create_backend
from tests.support.state import poll

from .conftest import (
    FailingSets,
    FailOnNthSet,
    GatedSets,
    Wrapped,
    keys_of,
    page_pattern,
    pin_bytes,
    write_pages,
)

MakeGroup = Callable[..., HostPoolGroup]
MakeIndex = Callable[..., ContentIndex]


def l3_run(backend: StorageBackend, index: ContentIndex, keys: list[str]) -> int:
    names = [e.name for e in index._view.group.entries]
    return backend.exists([f"{index.namespace}/{p}/{k}" for k in keys for p in names]) // len(names)


def test_write_through_backs_up_on_publish(
    make_group: MakeGroup, make_index: MakeIndex, l3_backend: StorageBackend
) -> None:
    group = make_group(16, derived=("draft",))
    index = make_index(group, l3_backend)
    keys = keys_of("w", 6)
    index.publish(keys, write_pages(group, 6, seed=1))
    assert index.flush(timeout_s=30) == 6
    assert l3_run(l3_backend, index, keys) == 6
    stats = index.stats()
    assert (stats.backed_up_pages, stats.l3_resident_entries, stats.queued_backup_pages) == (6, 6, 0)
    # Nothing to do the second time.
    assert index.backup(keys, wait=True) == BackupResult(0, 0)


def test_write_through_selective_backs_up_on_the_second_hit(
    make_group: MakeGroup, make_index: MakeIndex, l3_backend: StorageBackend
) -> None:
    group = make_group(16)
    index = make_index(group, l3_backend, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    keys = keys_of("s", 4)
    index.publish(keys, write_pages(group, 4, seed=2))
    index.flush(timeout_s=30)
    assert l3_run(l3_backend, index, keys) == 0
    index.unpin(index.pin(keys[:2]))  # first hit
    index.flush(timeout_s=30)
    assert l3_run(l3_backend, index, keys) == 0
    index.unpin(index.pin(keys[:2]))  # second hit of the first two keys
    assert index.flush(timeout_s=30) == 2
    assert l3_run(l3_backend, index, keys) == 2


def test_write_back_writes_only_when_evicted(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    backend = Wrapped(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    # No eviction ahead of a free share: the only L3 writes are those a reclaim asks for.
    index = make_index(group, backend, write_policy=WritePolicy.WRITE_BACK, write_back_free_fraction=0)
    keys = keys_of("b", 8)
    index.publish(keys, write_pages(group, 8, seed=3))
    assert backend.set_calls == 0
    # Only L2 holds them: nothing is evictable now (an allocation never waits for L3), and
    # the three least recently used start their way to L3 in the background.
    assert index.reclaimable("kv", 3) == 0
    assert index.reclaim("kv", 3) == 0
    allocator = group.get_pool("kv").allocator
    poll(allocator.available, lambda n: n == 3, 30.0, "three pages freed once written")
    assert backend.set_calls == 1
    assert index.lookup(keys) == LookupResult(l2_hit_pages=5, total_hit_pages=8)
    # A drain under write_back persists what is only in L2.
    assert index.flush(timeout_s=30) == 5
    assert l3_run(backend, index, keys) == 8
    backend.inner.close()


def test_backup_stops_at_the_first_failed_batch(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    backend = FailOnNthSet(create_backend("file", {"path": str(tmp_path / "l3")}), n=2)
    group = make_group(16)
    index = make_index(group, backend, write_policy=WritePolicy.WRITE_BACK, batch_pages=4, io_workers=2)
    keys = keys_of("f", 12)
    index.publish(keys, write_pages(group, 12, seed=4))
    failed = index.backup(keys, wait=True)
    assert (failed.queued, failed.stored) == (12, 4)
    assert failed.shortfall.startswith(
        "8 not confirmed in L3: L3 failed or refused their batch or an earlier one"
    )
    assert backend.set_calls == 2  # batch 3 was never tried
    assert l3_run(backend, index, keys) == 4
    stats = index.stats()
    assert (stats.backup_failed_pages, stats.dropped_backup_pages, stats.queued_backup_pages) == (4, 4, 0)
    # The pages stay cached in L2 and can be backed up again later.
    assert index.backup(keys, wait=True) == BackupResult(queued=8, stored=8)
    assert l3_run(backend, index, keys) == 12
    backend.inner.close()


def test_a_waited_backup_names_pages_cleared_while_it_wrote(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    index = make_index(group, backend, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    keys = keys_of("c", 4)
    index.publish(keys, write_pages(group, 4, seed=6))
    results: list[BackupResult] = []
    waiter = threading.Thread(target=lambda: results.append(index.backup(keys, wait=True, timeout_s=30)))
    waiter.start()
    try:
        assert backend.entered.acquire(timeout=30)  # its batch is being written
        assert index.clear() == (4, 0)
    finally:
        backend.gate.set()
        waiter.join(timeout=30)
    [result] = results
    assert (result.queued, result.stored) == (4, 0)
    assert result.shortfall == "4 no longer cached (cleared or evicted meanwhile)"
    backend.inner.close()


def test_backup_never_blocks_and_holds_its_pages(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    # Selective: nothing is backed up behind the test's back (no second hit happens).
    index = make_index(group, backend, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, max_queued_pages=6)
    keys = keys_of("g", 8)
    index.publish(keys, write_pages(group, 8, seed=5))
    try:
        assert index.backup(keys[:6]) == BackupResult(queued=6, stored=0)
        assert backend.entered.acquire(timeout=30)
        # While the writer is busy: the queue is full, queued pages cannot be evicted.
        with pytest.raises(ResourceExhausted, match="backup queue"):
            index.backup(keys)
        assert index.stats().queued_backup_pages == 6
        assert index.reclaim("kv", 8) == 2
    finally:
        backend.gate.set()
    assert index.flush(timeout_s=30) == 6
    assert index.reclaim("kv", 6) == 6
    assert index.lookup(keys) == LookupResult(0, 6)
    backend.inner.close()


def test_automatic_backups_drop_on_backpressure(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    index = make_index(group, backend, max_queued_pages=3)
    index.publish(keys_of("d", 5), write_pages(group, 5, seed=6))
    assert index.stats().dropped_backup_pages == 2
    backend.gate.set()
    assert index.flush(timeout_s=30) == 5  # the flush queues the two dropped ones again
    backend.inner.close()


def test_backup_without_backend_is_a_failed_precondition(
    make_group: MakeGroup, make_index: MakeIndex
) -> None:
    index = make_index(make_group(4))
    with pytest.raises(FailedPrecondition, match="no L3 backend"):
        index.backup(["a"])


def test_l3_pages_survive_the_index_and_read_back_exactly(
    make_group: MakeGroup, make_index: MakeIndex, open_l3: Callable[[], StorageBackend]
) -> None:
    first = open_l3()
    group_a = make_group(16, sidecars=("swa",), derived=("draft",))
    index_a = make_index(group_a, first)
    keys = keys_of("r", 10)
    index_a.publish(keys, write_pages(group_a, 10, seed=7))
    index_a.flush(timeout_s=30)
    index_a.close()

    # A new daemon: fresh pools, the backend re-opened (same directory / same redis).
    second = open_l3()
    group_b = make_group(16, sidecars=("swa",), derived=("draft",))
    index_b = make_index(group_b, second)
    assert index_b.lookup(keys) == LookupResult(0, 10)
    assert index_b.fetch_into_l2(keys) == 10
    pin = index_b.pin(keys)
    for i in range(10):
        got = pin_bytes(group_b, dict(pin.pages), i)
        for entry in group_b.entries:
            assert got[entry.name] == page_pattern(entry.host_pool.page_bytes, 7, i, entry.name)
    index_b.unpin(pin)
    index_b.close()


def test_clear_deletes_l3_pages(
    make_group: MakeGroup, make_index: MakeIndex, l3_backend: StorageBackend
) -> None:
    group = make_group(16, derived=("draft",))
    index = make_index(group, l3_backend)
    index.publish(keys_of("x", 3), write_pages(group, 3, seed=8), tenant="x")
    index.publish(keys_of("y", 2), write_pages(group, 2, seed=9), tenant="y")
    index.flush(timeout_s=30)
    assert index.clear("x") == (3, 3)
    assert index.lookup(keys_of("x", 3)) == LookupResult(0, 0)
    assert index.lookup(keys_of("y", 2)) == LookupResult(2, 2)
    assert index.clear() == (2, 2)
    assert index.lookup(keys_of("y", 2)) == LookupResult(0, 0)


def test_backup_wait_also_waits_for_keys_a_policy_already_queued(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(16)  # the policy's backups may hold half of it: all five
    index = make_index(group, backend)  # write_through: publish queues the keys
    keys = keys_of("q", 5)
    index.publish(keys, write_pages(group, 5, seed=10))
    assert backend.entered.acquire(timeout=30)
    assert index.backup(keys) == BackupResult(queued=5, stored=0)  # nothing new to queue
    results: list[BackupResult] = []
    waiter = threading.Thread(target=lambda: results.append(index.backup(keys, wait=True)))
    waiter.start()
    assert waiter.is_alive()  # blocked on the policy's job, held at the gate
    backend.gate.set()
    waiter.join(30)
    assert results == [BackupResult(queued=5, stored=5)]
    assert backend.set_calls == 1
    backend.inner.close()


def test_write_back_flush_persists_more_than_the_queue_holds(
    make_group: MakeGroup, make_index: MakeIndex, l3_backend: StorageBackend
) -> None:
    group = make_group(16)
    index = make_index(
        group, l3_backend, write_policy=WritePolicy.WRITE_BACK, max_queued_pages=3, batch_pages=2
    )
    keys = keys_of("wb", 10)
    index.publish(keys, write_pages(group, 10, seed=11))
    assert index.flush(timeout_s=30) == 10
    assert l3_run(l3_backend, index, keys) == 10
    assert index.stats().dropped_backup_pages == 0


def test_clear_during_a_backup_leaves_nothing_of_the_tenant_in_l3(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    index = make_index(group, backend)
    keys = keys_of("z", 4)
    index.publish(keys, write_pages(group, 4, seed=12), tenant="gone")
    assert backend.entered.acquire(timeout=30)  # the write-through batch is being written
    assert index.clear("gone") == (4, 0)
    assert group.available() == 4  # the pages being written are still held
    backend.gate.set()
    index.flush(timeout_s=30)
    assert group.available() == 8
    assert l3_run(backend, index, keys) == 0
    assert index.lookup(keys) == LookupResult(0, 0)
    backend.inner.close()


def test_write_back_evicts_ahead_of_need_in_the_background(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(16)
    index = make_index(
        group, backend, write_policy=WritePolicy.WRITE_BACK, write_back_free_fraction=0.25, batch_pages=4
    )
    keys = keys_of("e", 14)
    try:
        # 2 of 16 pages free < 25%: the 6 least recently used entries leave L2 (deepest
        # first), written to L3 by the I/O threads; publish itself did not wait.
        index.publish(keys, write_pages(group, 14, seed=13))
        assert backend.entered.acquire(timeout=30)
        assert index.lookup(keys).l2_hit_pages == 8
        assert group.available() == 2  # freed only once written
    finally:
        backend.gate.set()
    index.flush(timeout_s=30)
    assert group.available() == 8
    assert index.lookup(keys) == LookupResult(8, 14)
    assert index.stats().evicted_pages == 6


def test_models_never_match_even_on_a_shared_backend(
    make_group: MakeGroup, make_index: MakeIndex, l3_backend: StorageBackend
) -> None:
    group_a, group_b = make_group(8), make_group(8)
    model_a = make_index(group_a, l3_backend, namespace="hicached/model-a")
    model_b = make_index(group_b, l3_backend, namespace="hicached/model-b")
    keys = keys_of("same-tokens", 4)  # identical keys, as for the same prompt
    model_a.publish(keys, write_pages(group_a, 4, seed=14))
    model_a.flush(timeout_s=30)
    assert model_a.lookup(keys) == LookupResult(4, 4)
    assert model_b.lookup(keys) == LookupResult(0, 0)
    assert model_b.prefetch(keys, policy="wait_complete").planned_pages == 0
    assert model_b.fetch_into_l2(keys) == 0


class GateFirstSet(Wrapped):
    """The first ``set_from`` waits until the test opens the gate; later ones run at once."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        if not self.entered.is_set():
            self.entered.set()
            assert self.gate.wait(30), "test never opened the gate"
        return super().set_from(keys, srcs)


def _write_through(
    backend: StorageBackend, make_group: MakeGroup, make_index: MakeIndex
) -> tuple[HostPoolGroup, ContentIndex]:
    """A group of 8 pages and its index over ``backend`` (write_through, two I/O threads)."""
    group = make_group(8)
    return group, make_index(group, backend)


def _clear_during_first_write(
    index: ContentIndex, group: HostPoolGroup, backend: GateFirstSet, keys: list[str]
) -> None:
    """Publish ``keys`` (write-through) and clear them while their L3 write is held at the gate."""
    index.publish(keys, write_pages(group, len(keys), seed=5))
    assert backend.entered.wait(30)  # the first entries' write is in flight
    assert index.clear() == (len(keys), 0)


def test_a_cleared_entrys_late_write_does_not_delete_the_copy_of_its_key_published_again(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    """Fails before the fix: the cleared entry's write landed after the key was published
    again and backed up, and its orphan delete removed that copy while the index still counted
    the key as in L3 (evicted without a write, it was then lost)."""
    backend = GateFirstSet(create_backend("file", {"path": str(tmp_path / "l3")}))
    group, index = _write_through(backend, make_group, make_index)
    keys = keys_of("c", 2)
    try:
        _clear_during_first_write(index, group, backend, keys)
        index.publish(keys, write_pages(group, 2, seed=5))  # the same keys again, written at once
        assert index.backup(keys, wait=True, timeout_s=30) == BackupResult(2, 2)
    finally:
        backend.gate.set()
    index.flush(timeout_s=30)
    assert index.stats().l3_resident_entries == 2
    assert l3_run(backend, index, keys) == 2
    assert index.reclaim("kv", 2) == 2  # in L3: freed without a write
    assert index.lookup(keys) == LookupResult(0, 2)
    backend.inner.close()


class GateDelete(GateFirstSet):
    """As GateFirstSet; besides, once ``arm`` is set, the next ``delete`` waits for ``delete_gate``."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.arm = threading.Event()
        self.deleting = threading.Event()
        self.delete_gate = threading.Event()

    def delete(self, keys: Sequence[str]) -> int:
        if self.arm.is_set() and not self.deleting.is_set():
            self.deleting.set()
            assert self.delete_gate.wait(30), "test never opened the delete gate"
        return super().delete(keys)


def test_a_key_published_again_during_its_orphan_delete_is_not_counted_in_l3(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    """Fails before the fix: the key was published again and backed up after the late write
    found it an orphan but before that orphan's delete ran; the delete removed the new copy
    while the index counted the key as in L3 (evicted without a write, it was then lost)."""
    backend = GateDelete(create_backend("file", {"path": str(tmp_path / "l3")}))
    group, index = _write_through(backend, make_group, make_index)
    keys = keys_of("o", 2)
    try:
        _clear_during_first_write(index, group, backend, keys)
        backend.arm.set()
        backend.gate.set()  # the late write lands: its keys are orphans, their delete waits
        assert backend.deleting.wait(30)
        index.publish(keys, write_pages(group, 2, seed=5))
        index.backup(keys, wait=True, timeout_s=30)  # written while the orphan delete is pending
    finally:
        backend.gate.set()
        backend.delete_gate.set()
    # No backup queued any more (a flush would write the two again: L3 lacks them).
    assert index._writer.queue.wait_queued_at_most(0, 30)
    assert l3_run(backend, index, keys) == 0  # the delete removed the new copy too
    assert index.stats().l3_resident_entries == 0  # ... and the index knows it
    assert index.backup(keys, wait=True, timeout_s=30) == BackupResult(2, 2)  # so it writes them again
    assert l3_run(backend, index, keys) == 2
    assert index.reclaim("kv", 2) == 2
    assert index.lookup(keys) == LookupResult(0, 2)
    backend.inner.close()


def test_a_failed_eviction_ahead_leaves_the_next_one_free_to_run(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure inside the table's evict (injected; only a bug raises there) must not keep the
    write-back eviction slot claimed: every later eviction ahead would be skipped."""
    backend = create_backend("file", {"path": str(tmp_path / "l3")})
    group = make_group(16)
    index = make_index(
        group, backend, write_policy=WritePolicy.WRITE_BACK, write_back_free_fraction=0.25, batch_pages=4
    )
    table = index._table
    real = table._drop_refs_locked
    armed = [True]

    def fail_once_in_evict(entries: Sequence[Entry], *, pinned: bool) -> None:
        if armed[0] and sys._getframe(1).f_code.co_name == "evict":
            armed[0] = False
            raise RuntimeError("injected failure in evict")
        real(entries, pinned=pinned)

    monkeypatch.setattr(table, "_drop_refs_locked", fail_once_in_evict)
    keys = keys_of("x", 14)
    # 2 of 16 pages free < 25%: the eviction ahead runs, and fails inside the table.
    with pytest.raises(RuntimeError, match="injected"):
        index.publish(keys, write_pages(group, 14, seed=17))
    assert not armed[0]
    assert index.lookup(keys).l2_hit_pages == 8  # 6 detached by the failed eviction
    # The next eviction ahead runs: a reclaim of 1 finds no entry L3 holds and starts it;
    # 2 of 16 free, it evicts 8 - 2 = 6 more in the background.
    assert index.reclaimable("kv", 1) == 0
    index.flush(timeout_s=30)
    assert index.lookup(keys).l2_hit_pages == 2
    # The failed eviction's 6 victims stay held (the injected fault lost them, as a bug
    # would): give them back so that the pools end full.
    lost = list(table._held.values())
    assert len(lost) == 6
    table.release(lost)
    backend.close()


def test_a_write_through_flush_writes_what_an_outage_left_out(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    """Fails before: a page whose write-through backup failed (L3 down) was never tried again,
    and a flush (Drain, shutdown) answered 0 and success; now a flush queues it again."""
    backend = FailOnNthSet(create_backend("file", {"path": str(tmp_path / "l3")}), n=1)
    group = make_group(8)
    index = make_index(group, backend)  # write_through
    keys = keys_of("o", 4)
    index.publish(keys, write_pages(group, 4, seed=21))
    poll(lambda: index.stats().backup_failed_pages, lambda n: n == 4, 30.0, "the failed backup")
    assert l3_run(backend, index, keys) == 0
    assert index.flush(timeout_s=30) == 4
    assert l3_run(backend, index, keys) == 4
    backend.inner.close()


def test_a_flush_whose_writes_fail_says_so(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    """Fails before: with L3 refusing every write, a flush answered 0 pages and success."""
    backend = FailingSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    index = make_index(group, backend, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    keys = keys_of("n", 3)
    index.publish(keys, write_pages(group, 3, seed=22))
    assert index.backup(keys) == BackupResult(queued=3, stored=0)
    with pytest.raises(Unavailable, match="3 backup pages could not be written to L3"):
        index.flush(timeout_s=30)
    assert index.lookup(keys).l2_hit_pages == 3  # still cached
    backend.inner.close()


def test_automatic_backups_leave_half_the_pool_to_allocations_while_l3_stalls(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    """Fails before: every page queued for a write-through backup is held until written, so
    with L3 slow or down the queue took the whole pool and every allocation failed ("0
    reclaimable"). Now the policy's backups hold at most half of it."""
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    index = make_index(group, backend)  # write_through
    try:
        keys = keys_of("h", 8)
        index.publish(keys, write_pages(group, 8, seed=23))
        assert backend.entered.acquire(timeout=30)  # the first batch waits on L3
        stats = index.stats()
        assert (stats.queued_backup_pages, stats.dropped_backup_pages) == (4, 4)
        got = group.allocate({"kv": 4})
        assert got.ok, got.reason
        group.free(got.pages["kv"], pool="kv")
    finally:
        backend.gate.set()
    assert index.flush(timeout_s=30) == 4  # the four written; none of them evicted
    backend.inner.close()


def test_a_write_back_allocation_that_cannot_fit_changes_nothing(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    """Fails on the first cut of the background write-back: a request larger than what could
    ever be evicted still sent every unwritten entry to L3 and out of L2."""
    backend = Wrapped(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(16)
    index = make_index(group, backend, write_policy=WritePolicy.WRITE_BACK, write_back_free_fraction=0)
    keys = keys_of("i", 12)
    index.publish(keys, write_pages(group, 12, seed=24))
    assert not group.allocate({"kv": 100}).ok
    assert index.flush(timeout_s=30) == 12  # (what a drain writes; nothing was evicted)
    assert index.lookup(keys) == LookupResult(12, 12)
    backend.inner.close()


def test_a_write_back_allocation_finds_room_on_its_first_retry(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    """Fails on the first cut: its shortfall was counted past the entries already in L3, but the
    eviction took the least recently used ones whatever they were, so the oldest, already in
    L3, used it up and the retry found no room (it took three attempts)."""
    backend = Wrapped(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(16)
    index = make_index(group, backend, write_policy=WritePolicy.WRITE_BACK, write_back_free_fraction=0)
    old, new = keys_of("a", 4), keys_of("b", 12)
    index.publish(old, write_pages(group, 4, seed=25))
    assert index.backup(old, wait=True, timeout_s=30) == BackupResult(4, 4)  # in L3 and L2
    index.publish(new, write_pages(group, 12, seed=26))
    refused = group.allocate({"kv": 8})  # four could go now, eight are needed
    assert not refused.ok
    assert "(0 free, 4 reclaimable, 4 being freed: retry shortly)" in str(refused.reason)
    allocator = group.get_pool("kv").allocator
    poll(allocator.available, lambda n: n == 8, 30.0, "eight pages freed in the background")
    got = group.allocate({"kv": 8})
    assert got.ok, got.reason
    group.free(got.pages["kv"], pool="kv")
    backend.inner.close()


def test_a_stalled_write_through_flush_leaves_allocations_their_half(
    make_group: MakeGroup, make_index: MakeIndex, tmp_path: Path
) -> None:
    """Fails on the first cut: the flush queued every unwritten page past the policy's limit, so
    once it gave up on a stalled L3 the queue held the whole pool and allocations failed."""
    backend = GatedSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    index = make_index(group, backend)  # write_through
    try:
        index.publish(keys_of("s", 8), write_pages(group, 8, seed=27))
        assert backend.entered.acquire(timeout=30)  # four queued, their write waits on L3
        with pytest.raises(ResourceExhausted, match="still queued"):
            index.flush(timeout_s=0.5)
        got = group.allocate({"kv": 4})
        assert got.ok, got.reason
        group.free(got.pages["kv"], pool="kv")
    finally:
        backend.gate.set()
    assert index.flush(timeout_s=30) == 4  # the four the allocation left
    backend.inner.close()
