"""BackupQueue on its own: admission, release exactly once, counts, the eviction slot.

The queue knows nothing of entries: items here are ints, ``store`` records them in a dict
(the L3 of these tests) and jobs run on a real :class:`IoScheduler`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from hicached.errors import ResourceExhausted
from hicached.index.backup import BackupCounts, BackupQueue
from hicached.index.jobs import BackupJob, IoPriority, IoScheduler


class Harness:
    """A queue whose ``store`` refuses the items in ``refuse`` and raises on those in ``explode``."""

    def __init__(self, io: IoScheduler, *, max_pages: int = 8, batch_pages: int = 2) -> None:
        self.stored: dict[int, int] = {}
        self.released: list[tuple[int, bool]] = []
        self.refuse: set[int] = set()
        self.explode: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()
        self.queue: BackupQueue[int] = BackupQueue(
            name="test",
            max_pages=max_pages,
            batch_pages=batch_pages,
            store=self.store,
            release=self.release,
            submit=lambda job: io.submit(job, IoPriority.BACKUP),
        )

    def store(self, batch: Sequence[int]) -> tuple[int, int]:
        assert self.gate.wait(30), "test never opened the gate"
        if self.explode & set(batch):
            raise RuntimeError("backend bug")
        good = [i for i in batch if i not in self.refuse]
        with self._lock:
            for i in good:
                self.stored[i] = self.stored.get(i, 0) + 1
        return len(good), len(batch) - len(good)

    def release(self, items: Sequence[int], reached: bool) -> None:
        with self._lock:
            self.released.extend((i, reached) for i in items)

    def run(self, items: list[int], *, explicit: bool = False) -> BackupJob[int] | None:
        admitted = self.queue.admit(len(items), explicit=explicit)
        return self.queue.run(items[:admitted])


@pytest.fixture
def io() -> Iterator[IoScheduler]:
    scheduler = IoScheduler(2, "test-backup-queue")
    yield scheduler
    scheduler.close()


def test_items_are_written_in_batches_and_each_released_once(io: IoScheduler) -> None:
    h = Harness(io)
    job = h.run(list(range(5)))
    assert job is not None and job.wait(30)
    assert h.queue.wait_queued_at_most(0, 30)
    assert h.stored == dict.fromkeys(range(5), 1)
    assert sorted(h.released) == [(i, True) for i in range(5)]
    assert h.queue.counts() == BackupCounts(queued=0, backed_up=5, failed=0, dropped=0)


def test_a_failed_batch_stops_the_job_and_drops_the_rest(io: IoScheduler) -> None:
    h = Harness(io)
    h.refuse = {3}
    job = h.run(list(range(6)))  # batches [0 1] [2 3] [4 5]: the second fails
    assert job is not None and job.wait(30) and job.failed
    assert h.queue.wait_queued_at_most(0, 30)
    assert sorted(h.stored) == [0, 1, 2]
    assert sorted(h.released) == [(0, True), (1, True), (2, True), (3, True), (4, False), (5, False)]
    assert h.queue.counts() == BackupCounts(queued=0, backed_up=3, failed=1, dropped=2)


def test_a_store_that_raises_drops_its_batch_and_the_rest(io: IoScheduler) -> None:
    h = Harness(io)
    h.explode = {0}
    job = h.run([0, 1, 2])
    assert job is not None and job.wait(30)
    assert h.queue.wait_queued_at_most(0, 30)
    assert sorted(h.released) == [(0, False), (1, False), (2, False)]
    assert h.queue.counts() == BackupCounts(queued=0, backed_up=0, failed=0, dropped=3)


def test_admission_is_bounded(io: IoScheduler) -> None:
    h = Harness(io, max_pages=4)
    h.gate.clear()  # hold the first job's batches in store
    h.run([0, 1, 2])
    with pytest.raises(ResourceExhausted, match=r"2 pages would exceed the backup queue \(3/4"):
        h.run([10, 11], explicit=True)
    assert h.queue.counts().queued == 3  # the refused explicit request reserved nothing
    assert h.queue.admit(3, explicit=False) == 1  # a policy's backup takes what fits
    assert h.queue.counts() == BackupCounts(queued=4, backed_up=0, failed=0, dropped=2)
    assert not h.queue.wait_queued_at_most(0, 0.01)
    h.queue.run([20])
    h.gate.set()
    assert h.queue.wait_queued_at_most(0, 30)
    assert sorted(h.stored) == [0, 1, 2, 20]


def test_one_eviction_at_a_time_and_it_bypasses_the_bound(io: IoScheduler) -> None:
    h = Harness(io, max_pages=2)
    h.gate.clear()
    assert h.queue.begin_eviction()
    assert not h.queue.begin_eviction()  # claimed, not yet running
    h.queue.reserve_eviction(4)  # the only copies: over the bound of 2
    h.queue.run_eviction([0, 1, 2, 3])
    assert h.queue.counts().queued == 4
    assert not h.queue.begin_eviction()
    h.gate.set()
    assert h.queue.wait_queued_at_most(0, 30)
    assert h.queue.wait_for(h.queue.begin_eviction, 30)  # the slot is free once all are released
    h.queue.reserve_eviction(0)  # an eviction that found nothing to write frees the slot at once
    assert h.queue.begin_eviction()
