"""The content index's bounded queue of L2 -> L3 backups.

:class:`BackupQueue` admits pages up to ``max_pages``, cuts them into
batches, hands each job to the I/O threads and counts what L3 stored, what
failed and what was dropped. It knows nothing of entries, keys or pools:
its owner gives it, at construction, the two functions that touch those
(``store`` one batch, ``release`` items the queue is done with) and the one
that runs a job on the I/O threads (``submit``).

Thread-safety: every method may be called from any thread. The queue has
its own lock (a condition), never held while calling ``store``,
``release`` or ``submit``. :meth:`admit` and :meth:`reserve_eviction` only
take that lock, so an owner may call them with its own lock held (the
content index's entry table does: lock order table lock -> queue lock,
never the reverse).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from hicached.errors import InvalidArgument, ResourceExhausted
from hicached.index.entries import batches
from hicached.index.jobs import BackupJob

__all__ = ["BackupCounts", "BackupQueue"]

E = TypeVar("E")

# store(batch) -> (items L3 now holds, items L3 refused); raising counts the batch as dropped.
Store = Callable[[Sequence[E]], tuple[int, int]]
# release(items, reached): the queue is done with items; reached = their batch was written.
Release = Callable[[Sequence[E], bool], None]


@dataclasses.dataclass(frozen=True)
class BackupCounts:
    """Pages queued now, and totals since construction."""

    queued: int
    backed_up: int
    failed: int
    dropped: int


class BackupQueue(Generic[E]):
    """Admission, batching and accounting of L2 -> L3 backups (one item is one page per pool).

    Each admitted item is released exactly once, through ``release``: after
    ``store`` returned for its batch, or when its job stopped first (a failed
    batch stops the job) or was abandoned. Only then does it leave the
    queued count, so :meth:`wait_queued_at_most` returning means ``release``
    has run for everything that left.
    """

    def __init__(
        self,
        *,
        name: str,
        max_pages: int,
        batch_pages: int,
        store: Store[E],
        release: Release[E],
        submit: Callable[[BackupJob[E]], None],
    ) -> None:
        for what, value in (("max_queued_pages", max_pages), ("batch_pages", batch_pages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{what} must be a positive int, got {value!r}")
        self.name = name
        self.max_pages = max_pages
        self.batch_pages = batch_pages
        self._store = store
        self._release = release
        self._submit = submit
        self._cond = threading.Condition()
        self._queued = 0
        self._backed_up = 0
        self._failed = 0
        self._dropped = 0
        self._lost = 0  # see lost()
        self._eviction: int | None = None  # pages of the write-back eviction in flight

    # ------------------------------------------------------------ admission

    def admit(self, n: int, *, explicit: bool, limit: int | None = None) -> int:
        """Reserve room for ``n`` items; returns how many fit (the rest count as dropped).
        Pass them to :meth:`run`.

        ``explicit`` (a caller asked for these backups): ResourceExhausted
        when they do not all fit, and nothing is reserved. Otherwise ``limit``
        (if smaller) takes the place of ``max_pages`` as the bound of what is queued.
        """
        with self._cond:
            bound = self.max_pages if explicit or limit is None else min(self.max_pages, limit)
            room = max(0, bound - self._queued)
            if n > room and explicit:
                raise ResourceExhausted(
                    f"{n} pages would exceed the backup queue ({self._queued}/{self.max_pages} pages queued)",
                    retry_after_ms=100,
                )
            admitted = min(n, room)
            self._queued += admitted
            self._dropped += n - admitted
            return admitted

    def begin_eviction(self) -> bool:
        """Claim the one write-back eviction slot; False while an eviction is in flight.

        The claimer must call :meth:`reserve_eviction` next (with 0 if it evicts nothing), or
        :meth:`cancel_eviction` if it failed before.
        """
        with self._cond:
            if self._eviction is not None:
                return False
            self._eviction = 0
            return True

    def evicting(self) -> int:
        """Items of the write-back eviction in flight not yet released (0 when none runs)."""
        with self._cond:
            return self._eviction or 0

    def cancel_eviction(self) -> None:
        """Give the claimed slot back when :meth:`reserve_eviction` was never called (the
        claimer failed first); a no-op once it was."""
        with self._cond:
            if self._eviction == 0:  # reserved ones never read 0: at 0 the slot is freed (None)
                self._eviction = None

    # ------------------------------------------------------------ running

    def run(self, items: Sequence[E]) -> BackupJob[E] | None:
        """Write admitted ``items`` in the background, in order; the job (None when empty)."""
        return self._run(items, self._release_items)

    def reserve_eviction(self, n: int) -> None:
        """Queue ``n`` items of the claimed eviction, past the bound (they are the only copy);
        the slot frees once all are released (at once when ``n`` is 0). Pass them to
        :meth:`run_eviction`."""
        with self._cond:
            self._queued += n
            self._eviction = n or None

    def run_eviction(self, items: Sequence[E]) -> None:
        """Write the items :meth:`reserve_eviction` queued, in the background."""
        self._run(items, self._release_evicted)

    def _run(self, items: Sequence[E], release: Release[E]) -> BackupJob[E] | None:
        if not items:
            return None
        job: BackupJob[E] = BackupJob(
            batches(items, self.batch_pages), store=self._store_batch, release=release
        )
        self._submit(job)
        return job

    def _store_batch(self, batch: Sequence[E]) -> tuple[int, bool]:
        stored, failed = self._store(batch)
        with self._cond:
            self._backed_up += stored
            self._failed += failed
            self._lost += failed
        return stored, failed == 0

    def _release_items(self, items: Sequence[E], reached: bool, *, evicted: bool = False) -> None:
        self._release(items, reached)
        with self._cond:
            self._queued -= len(items)
            if not reached:
                self._dropped += len(items)
                self._lost += len(items)
            if evicted:
                assert self._eviction is not None
                self._eviction -= len(items)
                if self._eviction == 0:
                    self._eviction = None
            self._cond.notify_all()

    def _release_evicted(self, items: Sequence[E], reached: bool) -> None:
        self._release_items(items, reached, evicted=True)

    # ------------------------------------------------------------ waiting

    def wait_for(self, done: Callable[[], bool], timeout_s: float | None) -> bool:
        """Block until ``done()`` (re-checked after every release) or the timeout; its last value."""
        with self._cond:
            return self._cond.wait_for(done, timeout=timeout_s)

    def wait_queued_at_most(self, pages: int, timeout_s: float | None) -> bool:
        """Block until at most ``pages`` are queued; False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued <= pages, timeout=timeout_s)

    def wake(self) -> None:
        """Re-check every waiter's condition (the owner changed what they wait for)."""
        with self._cond:
            self._cond.notify_all()

    def counts(self) -> BackupCounts:
        with self._cond:
            return BackupCounts(self._queued, self._backed_up, self._failed, self._dropped)

    def lost(self) -> int:
        """Pages admitted and not written so far: L3 refused them, or their job stopped before
        them (a failed batch, a backend error, the index closing). Pages refused admission for
        want of room are not counted: no write was tried."""
        with self._cond:
            return self._lost
