"""The L2 -> L3 half of the content index: write policies, backup jobs, flush, write-back eviction.

:class:`BackupMixin` is a part of :class:`hicached.index.index.ContentIndex`
kept in its own module; it shares the index's lock and state (declared
below) and is not usable on its own. Locking rules are the index's: state
changes under ``_lock``, L3 I/O outside it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Sequence

from hicached.errors import FailedPrecondition, ResourceExhausted
from hicached.index.entries import Entry, batches, check_keys
from hicached.index.jobs import BackupJob, IoPriority, IoScheduler
from hicached.index.observer import IndexObserver
from hicached.index.pools import GroupView
from hicached.index.types import BackupResult, WritePolicy
from hicached.l3.base import StorageBackend

__all__ = ["BackupMixin"]

logger = logging.getLogger(__name__)


class BackupMixin:
    """L2 -> L3 operations of :class:`~hicached.index.index.ContentIndex`."""

    # State owned by ContentIndex.__init__.
    backend: StorageBackend | None
    namespace: str
    batch_pages: int
    max_queued_pages: int
    write_policy: WritePolicy
    write_back_free_fraction: float
    _lock: threading.Lock
    _idle: threading.Condition
    _entries: collections.OrderedDict[str, Entry]
    _view: GroupView
    _obs: IndexObserver
    _io: IoScheduler
    _counts: collections.Counter[str]
    _queued_pages: int
    _evicting_pages: int
    _closed: bool
    _l3_tenant_keys: dict[str, set[str]]

    def _drop_refs_locked(self, entries: Iterable[Entry], *, pinned: bool) -> None:
        raise NotImplementedError  # ContentIndex's

    def _evict_ahead(self) -> None:
        """write_back: when a pool's free share drops below ``write_back_free_fraction``,
        evict least recently used entries in the background until twice that share
        is free; each is written to L3 first and its pages are freed once written.

        This keeps a worker's allocation from waiting on L3 in :meth:`reclaim`
        (which still writes synchronously if the background falls behind).
        """
        if self.backend is None or self.write_back_free_fraction <= 0:
            return
        fraction = self.write_back_free_fraction
        allocators = self._view.allocators
        if all(a.available() >= a.capacity * fraction for a in allocators):
            return
        want = max(int(a.capacity * 2 * fraction) - a.available() for a in allocators)
        with self._lock:
            if self._closed or self._evicting_pages:
                return
            victims: list[Entry] = []
            for entry in self._entries.values():
                if len(victims) >= want:
                    break
                if entry.refs == 0:
                    victims.append(entry)
            for entry in victims:
                del self._entries[entry.key]
                entry.detached = True
                entry.refs += 1
            dirty = [e for e in victims if not e.in_l3]
            for entry in dirty:
                entry.backup_queued = True
            self._queued_pages += len(dirty)
            self._evicting_pages = len(dirty)
            self._counts["evicted"] += len(victims)
            self._drop_refs_locked([e for e in victims if e.in_l3], pinned=False)
        if not victims:
            return
        self._obs.evicted("l2", "lru", len(victims))
        if dirty:
            job: BackupJob[Entry] = BackupJob(
                batches(dirty, self.batch_pages), store=self._store_batch, release=self._release_evicted
            )
            self._io.submit(job, IoPriority.BACKUP)

    def _release_evicted(self, entries: Sequence[Entry], attempted: bool) -> None:
        self._release_backup(entries, attempted)  # detached: their pages are freed here
        with self._lock:
            self._evicting_pages -= len(entries)

    def _write_back_now(self, entries: Sequence[Entry]) -> None:
        chunks = batches(entries, self.batch_pages)
        for i, batch in enumerate(chunks):
            try:
                _, ok = self._store_batch(batch)
            except Exception:
                logger.exception("%s: write-back of an evicted batch failed", self.namespace)
                ok = False
            if not ok:
                lost = sum(not e.in_l3 for b in chunks[i:] for e in b)
                with self._lock:
                    self._counts["dropped_backup"] += lost
                self._obs.dropped("backup_failed", lost)
                return

    def _queue_backup(self, entries: Sequence[Entry], *, explicit: bool) -> BackupJob[Entry] | None:
        if self.backend is None or not entries:
            return None
        dropped = 0
        with self._lock:
            todo = [e for e in entries if not (e.detached or e.in_l3 or e.backup_queued)]
            room = self.max_queued_pages - self._queued_pages
            if len(todo) > room:
                if explicit:
                    raise ResourceExhausted(
                        f"{len(todo)} pages would exceed the backup queue "
                        f"({self._queued_pages}/{self.max_queued_pages} pages queued)",
                        retry_after_ms=100,
                    )
                dropped = len(todo) - max(0, room)
                todo = todo[: max(0, room)]
            for entry in todo:
                entry.refs += 1
                entry.backup_queued = True
            self._queued_pages += len(todo)
            self._counts["dropped_backup"] += dropped
        if dropped:
            self._obs.dropped("backpressure", dropped)
        if not todo:
            return None
        job: BackupJob[Entry] = BackupJob(
            batches(todo, self.batch_pages),
            store=self._store_batch,
            release=self._release_backup,
        )
        self._io.submit(job, IoPriority.BACKUP)
        return job

    def _store_batch(self, batch: Sequence[Entry]) -> tuple[int, bool]:
        """Write one batch to L3; (keys now stored, every key succeeded)."""
        assert self.backend is not None
        live = [e for e in batch if not e.cleared]
        if not live:
            return 0, True
        started = time.perf_counter()
        keys = [e.key for e in live]
        results = self.backend.set_from(
            self._view.l3_keys(self.namespace, keys), self._view.chunks([e.pages for e in live])
        )
        seconds = time.perf_counter() - started
        ok = self._view.whole_keys(results)
        stored = sum(ok)
        orphans: list[str] = []
        with self._lock:
            for entry, good in zip(live, ok, strict=True):
                if not good:
                    continue
                if entry.cleared:  # clear() ran while we wrote: it must not come back
                    orphans.append(entry.key)
                    continue
                entry.in_l3 = True
                if entry.tenant:
                    self._l3_tenant_keys.setdefault(entry.tenant, set()).add(entry.key)
            self._counts["backed_up"] += stored
            self._counts["backup_failed"] += len(live) - stored
        if orphans:
            self.backend.delete(self._view.l3_keys(self.namespace, orphans))
        if stored:
            self._obs.backed_up(stored, stored * self._view.key_bytes, seconds)
        return stored, stored == len(live)

    def _release_backup(self, entries: Sequence[Entry], reached: bool) -> None:
        with self._lock:
            for entry in entries:
                entry.backup_queued = False
            self._queued_pages -= len(entries)
            if not reached:
                self._counts["dropped_backup"] += len(entries)
            if not self._closed:
                self._drop_refs_locked(entries, pinned=False)
            self._idle.notify_all()
        if not reached:
            self._obs.dropped("backup_failed", len(entries))

    def backup(
        self, keys: Sequence[str], *, wait: bool = False, timeout_s: float | None = None
    ) -> BackupResult:
        """Queue an L2 -> L3 backup of the cached keys among ``keys`` that L3 lacks.

        ``queued`` counts those keys (including ones a write policy had already
        queued). Returns at once unless ``wait``; then it also waits for the
        keys other jobs were writing, and ``stored`` counts the ones L3 has
        acknowledged (a job stops at its first failed batch). Raises
        FailedPrecondition without a backend and ResourceExhausted when the
        queue is full (nothing queued then). A wait ends at ``timeout_s`` and
        then reports what L3 has acknowledged so far.
        """
        keys = check_keys(keys)
        if self.backend is None:
            raise FailedPrecondition(f"content index {self.namespace!r} has no L3 backend")
        with self._lock:
            pending = [e for k in keys if (e := self._entries.get(k)) is not None and not e.in_l3]
        job = self._queue_backup(pending, explicit=True)
        if not wait:
            return BackupResult(len(pending), 0)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if job is not None:
            job.wait(remaining())
        with self._idle:
            self._idle.wait_for(lambda: not any(e.backup_queued for e in pending), timeout=remaining())
            return BackupResult(len(pending), sum(e.in_l3 for e in pending))

    def flush(self, timeout_s: float | None = None) -> int:
        """Wait until no backup is queued; returns pages stored meanwhile.

        Under ``write_back`` every entry not yet in L3 is queued first, in
        chunks that fit the queue (a drain before shutdown must not lose the
        only copy). Raises ResourceExhausted if the queue is still busy at
        ``timeout_s``.
        """
        before = self._counts["backed_up"]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        def busy() -> ResourceExhausted:
            return ResourceExhausted(
                f"{self._queued_pages} backup pages still queued after {timeout_s} s", retry_after_ms=100
            )

        if self.write_policy is WritePolicy.WRITE_BACK and self.backend is not None:
            with self._lock:
                dirty = [e for e in self._entries.values() if not (e.in_l3 or e.backup_queued)]
            for chunk in batches(dirty, self.max_queued_pages):
                if not self._wait_queue_at_most(self.max_queued_pages - len(chunk), remaining()):
                    raise busy()
                self._queue_backup(chunk, explicit=False)
        if not self._wait_queue_at_most(0, remaining()):
            raise busy()
        return self._counts["backed_up"] - before

    def _wait_queue_at_most(self, pages: int, timeout_s: float | None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._queued_pages <= pages, timeout=timeout_s)
