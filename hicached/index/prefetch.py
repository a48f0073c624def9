"""The L3 -> L2 half of the content index: background prefetches and synchronous fetches.

A fetched batch lands in fresh pages from the group's one allocation path
(which may evict through the index: group lock -> table lock) and is
published through the :class:`~hicached.index.table.EntryTable` at once,
so other workers can use it before the prefetch ends.

Thread-safety: every public method may be called from any thread. The
prefetcher's lock guards only its registry of tasks; it is never held
while allocating, reading L3 or publishing.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import uuid
from collections.abc import Callable, Sequence, Set

import numpy as np

from hicached.errors import NotFound, clip
from hicached.index.entries import batches
from hicached.index.jobs import PrefetchTask
from hicached.index.observer import IndexObserver
from hicached.index.pools import GroupView
from hicached.index.table import EntryTable
from hicached.index.types import PrefetchPolicy
from hicached.l2.allocator import PageArray
from hicached.l3.base import StorageBackend

__all__ = ["Prefetcher"]


class Prefetcher:
    """Prefetch tasks of one index (the last ``max_finished`` finished ones are kept)."""

    def __init__(
        self,
        table: EntryTable,
        view: GroupView,
        *,
        backend: StorageBackend | None,
        namespace: str,
        batch_pages: int,
        max_finished: int,
        observer: IndexObserver,
        submit: Callable[[PrefetchTask], None],
    ) -> None:
        self._table = table
        self._view = view
        self._backend = backend
        self._namespace = namespace
        self._batch_pages = batch_pages
        self._max_finished = max_finished
        self._obs = observer
        self._submit = submit
        self._lock = threading.Lock()
        self._tasks: collections.OrderedDict[str, tuple[PrefetchTask, str]] = collections.OrderedDict()

    def start(
        self, plan: Sequence[str], *, policy: PrefetchPolicy, timeout_s: float, tenant: str
    ) -> PrefetchTask:
        """Copy the ``plan`` keys (L3-only, in prefix order) into L2 in the background."""
        task = PrefetchTask(
            uuid.uuid4().hex,
            plan,
            policy=policy,
            timeout_s=timeout_s,
            batch_pages=self._batch_pages,
            fetch=functools.partial(self._fetch_batch, tenant),
        )
        with self._lock:
            self._tasks[task.id] = (task, tenant)
            self._forget_finished_locked()
        if plan:
            self._submit(task)
        return task

    def _forget_finished_locked(self) -> None:
        """Keep ``max_finished`` finished tasks: past that, forget the oldest of the tenant
        holding the most, so one tenant's flood of prefetches (an empty one finishes at once)
        forgets its own tickets, not another's still to be asked about. O(tasks)."""
        finished = [(tid, owner) for tid, (t, owner) in self._tasks.items() if t.finished]
        excess = len(finished) - self._max_finished
        if excess <= 0:
            return
        held = collections.Counter(owner for _, owner in finished)
        for _ in range(excess):  # one, unless max_finished was lowered
            most = max(held, key=held.__getitem__)
            oldest = next(tid for tid, owner in finished if owner == most and tid in self._tasks)
            del self._tasks[oldest]
            held[most] -= 1

    def get(self, prefetch_id: str) -> PrefetchTask:
        with self._lock:
            found = self._tasks.get(prefetch_id)
        if found is None:
            raise NotFound(f"prefetch {clip(prefetch_id)} is unknown (or finished long ago)")
        return found[0]

    def kept(self, prefetch_ids: Set[str]) -> set[str]:
        with self._lock:
            return {pid for pid in prefetch_ids if pid in self._tasks}

    def running(self, prefetch_ids: Set[str] | None = None) -> int:
        """Running or queued prefetches (of ``prefetch_ids``, or all)."""
        with self._lock:
            return sum(
                not t.finished
                for tid, (t, _) in self._tasks.items()
                if prefetch_ids is None or tid in prefetch_ids
            )

    def cancel(self, tenant: str | None = None, wait: bool = True) -> None:
        """Cancel every prefetch (or one tenant's); returns once none of their batches is in
        flight (``wait=False``: at once, see :meth:`PrefetchTask.cancel`)."""
        with self._lock:
            tasks = [t for t, owner in self._tasks.values() if tenant is None or owner == tenant]
        for task in tasks:
            task.cancel(wait)

    def fetch_now(self, keys: Sequence[str], tenant: str) -> None:
        """Copy ``keys`` (L3-only, in prefix order) into L2 on this thread; stops at the
        first batch that cannot be fetched whole."""
        for batch in batches(keys, self._batch_pages):
            _, ok = self._fetch_batch(tenant, batch, lambda: False)
            if not ok:
                return

    def _alloc_rows(self, n: int) -> list[PageArray] | None:
        """``n`` pages of every independent pool, or None and nothing (the group's one
        allocation path: it evicts only when all of them will then fit)."""
        # Every pool's pages (derived ones too: chunks() covers each slot) are filled from L3
        # whole, or freed: none needs zeroing.
        got = self._view.group.allocate(
            dict.fromkeys(self._view.alloc_names, n), fills=[s.name for s in self._view.slots]
        )
        return [got.pages[name] for name in self._view.alloc_names] if got.ok else None

    def _fetch_batch(self, tenant: str, keys: Sequence[str], discard: Callable[[], bool]) -> tuple[int, bool]:
        """L3 -> fresh L2 pages -> published; (keys now in L2, whole batch succeeded)."""
        assert self._backend is not None
        columns = self._alloc_rows(len(keys))
        if columns is None:
            return 0, False
        rows = list(zip(*(c.tolist() for c in columns), strict=True))
        good = 0
        mask = np.zeros(0, dtype=bool)
        epoch = self._table.clear_epoch()  # a clear during the read: publish nothing
        try:
            started = time.perf_counter()
            results = self._backend.get_into(
                self._view.l3_keys(self._namespace, keys), self._view.chunks(rows)
            )
            seconds = time.perf_counter() - started
            ok = self._view.whole_keys(results)
            good = ok.index(False) if False in ok else len(ok)
            if not discard():
                mask, _, _ = self._table.insert(
                    keys[:good], [c[:good] for c in columns], tenant, in_l3=True, strict=False, epoch=epoch
                )
        finally:
            keep = np.zeros(len(keys), dtype=bool)
            keep[: mask.size] = mask
            for allocator, column in zip(self._view.allocators, columns, strict=True):
                if (~keep).any():
                    allocator.free(column[~keep])
        if mask.size == 0:
            return 0, False
        self._obs.prefetched(good, good * self._view.key_bytes, seconds)
        return good, good == len(keys)
