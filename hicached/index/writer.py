"""The L2 -> L3 half of the content index: write policies, explicit backups, flush, write-back eviction.

:class:`Writer` decides which entries go to L3 and when; the
:class:`~hicached.index.backup.BackupQueue` it owns bounds, batches and
counts the writes, calling back only :meth:`Writer._store` (one batch to
the backend) and :meth:`Writer._release` (hand the entries back to the
:class:`~hicached.index.table.EntryTable`).

Thread-safety: every public method may be called from any thread. The
writer has no lock of its own: entry state changes through the table
(its lock), queue state through the queue (its lock, taken inside the
table's by :meth:`EntryTable.claim`); L3 I/O and observer calls happen
with neither held.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hicached.errors import NO_RETRY, FailedPrecondition, ResourceExhausted, Unavailable
from hicached.index.backup import BackupCounts, BackupQueue
from hicached.index.entries import Entry
from hicached.index.jobs import BackupJob
from hicached.index.observer import IndexObserver
from hicached.index.pools import GroupView
from hicached.index.table import EntryTable
from hicached.index.types import BackupResult, WritePolicy
from hicached.l3.base import StorageBackend

__all__ = ["Writer"]


class Writer:
    """Backs entries of one :class:`EntryTable` up to one backend under one write policy.

    ``submit`` runs a backup job on the index's I/O threads. With no backend
    every method is a no-op except :meth:`backup` (FailedPrecondition).
    """

    def __init__(
        self,
        table: EntryTable,
        view: GroupView,
        *,
        backend: StorageBackend | None,
        namespace: str,
        policy: WritePolicy,
        max_queued_pages: int,
        batch_pages: int,
        free_fraction: float,
        observer: IndexObserver,
        submit: Callable[[BackupJob[Entry]], None],
    ) -> None:
        self._table = table
        self._view = view
        self._backend = backend
        self._namespace = namespace
        self._policy = policy
        self._free_fraction = free_fraction
        self._obs = observer
        self.queue: BackupQueue[Entry] = BackupQueue(
            name=namespace,
            max_pages=max_queued_pages,
            batch_pages=batch_pages,
            store=self._store,
            release=self._release,
            submit=submit,
        )

    # ------------------------------------------------------------ policy hooks

    def published(self, new: Sequence[Entry], hot: Sequence[Entry]) -> None:
        """Entries just published (new) or hit again (hot): back up as the policy says."""
        if self._policy is WritePolicy.WRITE_THROUGH:
            self._queue(new, explicit=False)
        elif self._policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._queue(hot, explicit=False)
        else:
            self.evict_ahead()

    def pinned(self, hot: Sequence[Entry]) -> None:
        if self._policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._queue(hot, explicit=False)

    def restored(self, entries: Sequence[Entry]) -> None:
        if self._policy is WritePolicy.WRITE_THROUGH:
            self._queue([e for e in entries if not e.in_l3], explicit=False)

    @property
    def _write_back(self) -> bool:
        return self._policy is WritePolicy.WRITE_BACK and self._backend is not None

    def reclaimable(self, wanted: int) -> int:
        """How many of ``wanted`` entries :meth:`reclaim` could evict now. Under ``write_back``
        only entries L3 holds count: the others must be written first, which an allocation
        never waits for (a hung L3 would hold it, and the group's lock, for the backend's
        timeout). When those fall short but the ``wanted`` least recently used entries are
        free to go, those start their way out in the background (:meth:`evict_ahead`), so a
        retry finds room; a request that could not fit anyway changes nothing."""
        if not self._write_back:
            return self._table.evictable(wanted)
        able = self._table.evictable(wanted, in_l3_only=True)
        if able < wanted and self._table.evictable(wanted) == wanted:
            self.evict_ahead(need=wanted)
        return able

    def reclaim(self, wanted: int) -> int:
        """Evict up to ``wanted`` LRU entries now (under ``write_back`` only those L3 holds, as
        :meth:`reclaimable` counts); returns the entries evicted. Writes nothing, waits for nothing."""
        evicted, _ = self._table.evict(wanted, hold_dirty=False, in_l3_only=self._write_back)
        if evicted:
            self._obs.evicted("l2", "lru", evicted)
            if self._write_back:
                self.evict_ahead()
        return evicted

    def evict_ahead(self, need: int = 0) -> None:
        """write_back: when a pool's free share drops below ``write_back_free_fraction``,
        evict least recently used entries in the background until twice that share
        is free (at least ``need`` entries); each is written to L3 first and its pages are
        freed once written. One eviction at a time: while one runs, this does nothing.

        This is what makes room for allocations under ``write_back``: :meth:`reclaim`
        evicts only entries L3 already holds.
        """
        if not self._write_back or self._table.closed:
            return
        fraction = self._free_fraction
        allocators = self._view.allocators
        want = need
        if fraction > 0 and any(a.available() < a.capacity * fraction for a in allocators):
            want = max(want, *(int(a.capacity * 2 * fraction) - a.available() for a in allocators))
        if want <= 0 or not self.queue.begin_eviction():
            return
        try:
            evicted, dirty = self._table.evict(want, hold_dirty=True, queue_dirty=self.queue.reserve_eviction)
        except BaseException:
            self.queue.cancel_eviction()  # or no eviction ahead would ever run again
            raise
        self.queue.run_eviction(dirty)
        if evicted:
            self._obs.evicted("l2", "lru", evicted)

    # ------------------------------------------------------------ the queue's callbacks

    def _queue(self, entries: Sequence[Entry], *, explicit: bool) -> BackupJob[Entry] | None:
        if self._backend is None or not entries:
            return None
        admit = self.queue.admit
        limit = self._policy_limit()
        todo, dropped = self._table.claim(entries, lambda n: admit(n, explicit=explicit, limit=limit))
        if dropped:
            self._obs.dropped("backpressure", dropped)
        return self.queue.run(todo)

    def _policy_limit(self) -> int:
        """Pages the write policy's own backups may hold queued. A queued entry cannot be
        evicted (L3 reads its pages), so half the smallest pool: with L3 slow or down, the
        other half stays evictable for allocations (the queue held every page, and every
        allocation failed)."""
        return max(1, min(a.capacity for a in self._view.allocators) // 2)

    def _store(self, batch: Sequence[Entry]) -> tuple[int, int]:
        """Write one batch to L3 (on an I/O thread); (keys now stored, keys refused)."""
        assert self._backend is not None
        live = [e for e in batch if not e.cleared]
        if not live:
            return 0, 0
        started = time.perf_counter()
        keys = [e.key for e in live]
        epoch = self._table.clear_epoch()  # a clear's L3 delete may remove what this writes
        results = self._backend.set_from(
            self._view.l3_keys(self._namespace, keys), self._view.chunks([e.pages for e in live])
        )
        seconds = time.perf_counter() - started
        ok = self._view.whole_keys(results)
        orphans, tenants = self._table.mark_stored(live, ok, epoch)
        if orphans:
            try:
                self._backend.delete(self._view.l3_keys(self._namespace, orphans))
            finally:
                self._table.end_clear(tenants)
        stored = sum(ok)
        if stored:
            self._obs.backed_up(stored, stored * self._view.key_bytes, seconds)
        if refused := len(live) - stored:  # L3 answered and took them not (full, refusing)
            self._obs.dropped("backup_failed", refused)
        return stored, refused

    def _release(self, entries: Sequence[Entry], reached: bool) -> None:
        self._table.unclaim(entries)
        if not reached:
            self._obs.dropped("backup_failed", len(entries))

    # ------------------------------------------------------------ explicit backup / flush

    def backup(self, keys: Sequence[str], *, wait: bool, timeout_s: float | None) -> BackupResult:
        """See :meth:`hicached.index.index.ContentIndex.backup`."""
        if self._backend is None:
            raise FailedPrecondition(f"content index {self._namespace!r} has no L3 backend")
        pending = self._table.not_in_l3(keys)
        job = self._queue(pending, explicit=True)
        if not wait:
            return BackupResult(len(pending), 0)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if job is not None:
            job.wait(remaining())
        # The flags are the table's; each release changes them before it wakes the queue's waiters.
        self.queue.wait_for(lambda: not any(e.backup_queued for e in pending), remaining())
        # One read of each entry's flags (without the table's lock: they may change just
        # after, but the counts and the reasons then describe one moment).
        flags = [(e.in_l3, e.backup_queued, e.detached) for e in pending]
        stored = sum(in_l3 for in_l3, _, _ in flags)
        return BackupResult(len(pending), stored, _shortfall(flags, timeout_s))

    def flush(self, timeout_s: float | None) -> int:
        """See :meth:`hicached.index.index.ContentIndex.flush`."""
        queue = self.queue
        stored, lost = queue.counts().backed_up, queue.lost()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        def busy() -> ResourceExhausted:
            return ResourceExhausted(
                f"{queue.counts().queued} backup pages still queued after {timeout_s} s", retry_after_ms=100
            )

        if self._policy in (WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH) and self._backend is not None:
            # Every page the policy means L3 to hold and it lacks: under write_back the only
            # copies (held until written in any case), under write_through those a failed
            # write (an L3 outage) left behind, queued within the policy's limit so that a
            # stalled flush leaves allocations their half of the pool. Each chunk is queued
            # whole, never partly dropped. Another caller may take the room between the wait
            # and the claim; then wait for room again.
            room = queue.max_pages
            if self._policy is WritePolicy.WRITE_THROUGH:
                room = min(room, self._policy_limit())
            pending = self._table.dirty()
            while pending:
                chunk = pending[:room]
                if not queue.wait_queued_at_most(room - len(chunk), remaining()):
                    raise busy()
                try:
                    self._queue(chunk, explicit=True)
                except ResourceExhausted:
                    continue
                pending = pending[len(chunk) :]
        if not queue.wait_queued_at_most(0, remaining()):
            raise busy()
        stored, lost = queue.counts().backed_up - stored, queue.lost() - lost
        if lost:
            raise Unavailable(
                f"{lost} backup pages could not be written to L3 meanwhile ({stored} were): the "
                "backend failed (the daemon's log says how); a later flush tries again those L2 "
                "still holds",
                retry_after_ms=NO_RETRY,  # not at once, by the channel: it would fail alike
            )
        return stored

    def counts(self) -> BackupCounts:
        return self.queue.counts()


def _shortfall(flags: Sequence[tuple[bool, bool, bool]], timeout_s: float | None) -> str:
    """Why a waited backup stored fewer pages than it queued, each reason with its count, from
    one read of each entry's (in L3, queued, detached) flags; "" when all are in L3."""
    writing = sum(queued and not in_l3 for in_l3, queued, _ in flags)
    gone = sum(detached and not (in_l3 or queued) for in_l3, queued, detached in flags)
    other = sum(not (in_l3 or queued or detached) for in_l3, queued, detached in flags)
    parts = []
    if writing:
        parts.append(f"{writing} still being written when the wait ended after {timeout_s} s (they go on)")
    if gone:
        parts.append(f"{gone} no longer cached (cleared or evicted meanwhile)")
    if other:
        parts.append(
            f"{other} not confirmed in L3: L3 failed or refused their batch or an earlier one (a "
            "backup stops at its first failed batch; the daemon's log says how), or a clear ran "
            "while they were written; a later backup tries again those L2 still holds"
        )
    return "; ".join(parts)
