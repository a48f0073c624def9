"""The content index: content key -> host (L2) pages, plus L3 backup and prefetch.

One :class:`ContentIndex` serves one host pool group, i.e. one model/layout
namespace shared by every worker attached to it: a page one worker published
can be pinned and loaded by another (worker B reuses worker A's prefix).
Tenants never match because their key chains are seeded differently
(:func:`hicached.index.keys.page_keys`); each entry also keeps its tenant label
so :meth:`ContentIndex.clear` can drop one tenant.

Ownership: the index owns the pages of every key it holds (one page per
independent pool). A :class:`Pin` lends them out read-only; a pinned page is
never evicted or freed until its last pin is released. Every page the index
ever owned is freed exactly once, by eviction, :meth:`ContentIndex.clear` or
:meth:`ContentIndex.close`.

Eviction is LRU over unpinned entries. Keys of one prefix are touched
deepest-first, so the deepest page of a prefix is the least recently used
and leaves before its parents (what a radix tree's leaf-first eviction
does): an eviction shortens a cached prefix instead of cutting its head.

L3 keys are ``f"{namespace}/{pool}/{key}"`` (one object per pool per key,
derived pools included). Backups and prefetches run on the index's I/O
threads in batches (128 pages by default), prefetches first; neither ever
blocks the caller unless asked to. Under ``write_back`` a page goes to L3
only when it is evicted; to keep that write off a worker's allocation path,
the index evicts ahead of need in the background whenever a pool's free
share drops below ``write_back_free_fraction`` (a reclaim that still finds
only unwritten victims writes them synchronously, as the reference does).

Thread-safety: every public method may be called from any thread. One lock
guards the index's state; it is never held during L3 I/O, nor while
calling into the pool group (the group calls :meth:`ContentIndex.reclaim`
with its own lock held, so the order is always group lock -> index lock).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from hicached.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from hicached.index.backup import BackupMixin
from hicached.index.entries import (
    SELECTIVE_HITS,
    Entry,
    EntryRecord,
    batches,
    check_keys,
    check_records,
    check_rows,
)
from hicached.index.jobs import IoPriority, IoScheduler, PrefetchTask
from hicached.index.observer import IndexObserver, NullIndexObserver
from hicached.index.pools import GroupView
from hicached.index.types import (
    DEFAULT_BATCH_PAGES,
    IndexStats,
    LookupResult,
    Pin,
    PrefetchPolicy,
    WritePolicy,
    prefetch_deadline_s,
)
from hicached.l2.allocator import PageAllocator, PageArray
from hicached.l2.group import HostPoolGroup
from hicached.l3.base import StorageBackend

__all__ = ["ContentIndex"]

logger = logging.getLogger(__name__)

# Process-wide, so a pin handed to the wrong index is refused rather than
# releasing someone else's pages.
_PIN_IDS = itertools.count(1)


class ContentIndex(BackupMixin):
    """Content key -> L2 pages of one host pool group, with L3 behind it.

    See the module docstring for ownership, eviction and locking. Configuration
    errors raise :class:`~hicached.errors.InvalidArgument`; nothing is installed
    then.
    """

    def __init__(
        self,
        group: HostPoolGroup,
        *,
        namespace: str,
        backend: StorageBackend | None,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        io_workers: int = 2,
        max_queued_pages: int = 65536,
        observer: IndexObserver | None = None,
        batch_pages: int = DEFAULT_BATCH_PAGES,
        prefetch_timeout_base_s: float = 1.0,
        prefetch_timeout_per_1k_tokens_s: float = 0.25,
        max_finished_prefetches: int = 1024,
        write_back_free_fraction: float = 0.125,
    ) -> None:
        if not isinstance(namespace, str) or not namespace or namespace.endswith("/"):
            raise InvalidArgument(f"namespace must be a non-empty str not ending in '/', got {namespace!r}")
        try:
            self.write_policy = WritePolicy(write_policy)
        except ValueError:
            raise InvalidArgument(
                f"unknown write policy {write_policy!r}; use one of {[p.value for p in WritePolicy]}"
            ) from None
        for name, value in (
            ("max_queued_pages", max_queued_pages),
            ("batch_pages", batch_pages),
            ("max_finished_prefetches", max_finished_prefetches),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        prefetch_deadline_s(0, prefetch_timeout_base_s, prefetch_timeout_per_1k_tokens_s)  # validates
        if not 0 <= write_back_free_fraction < 0.5:
            raise InvalidArgument(
                f"write_back_free_fraction must be in [0, 0.5), got {write_back_free_fraction!r}"
            )
        self.write_back_free_fraction = write_back_free_fraction
        self.namespace = namespace
        self.backend = backend
        self.batch_pages = batch_pages
        self.max_queued_pages = max_queued_pages
        self._view = GroupView(group)
        self._obs: IndexObserver = observer if observer is not None else NullIndexObserver()
        self._timeout_base = prefetch_timeout_base_s
        self._timeout_per_1k = prefetch_timeout_per_1k_tokens_s
        self._max_finished = max_finished_prefetches

        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when queued backups drop
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._owned = [np.zeros(a.capacity, dtype=bool) for a in self._view.allocators]
        self._pins: dict[int, tuple[Entry, ...]] = {}
        self._pinned_entries = 0
        self._queued_pages = 0
        self._l3_tenant_keys: dict[str, set[str]] = {}
        self._prefetches: collections.OrderedDict[str, PrefetchTask] = collections.OrderedDict()
        self._prefetch_tenant: dict[str, str] = {}
        self._closed = False
        self._frozen = False  # export_entries() took the final snapshot: no more changes
        self._counts = collections.Counter[str]()
        self._evicting_pages = 0  # write_back: pages of the background eviction in flight

        self._io = IoScheduler(io_workers, f"hicache-{namespace}")
        # Installed last: from here on the group may call back into us.
        self._previous_reclaim: dict[str, Callable[[int], int] | None] = {}
        self._previous_reclaimable: dict[str, Callable[[int], int] | None] = {}
        for entry in group.entries:
            if entry.indices_from_pool is None:
                self._previous_reclaim[entry.name] = entry.reclaim
                self._previous_reclaimable[entry.name] = entry.reclaimable
                entry.reclaimable = functools.partial(
                    self._reclaimable_callback, entry.name, entry.reclaim, entry.reclaimable
                )
                entry.reclaim = functools.partial(self._reclaim_callback, entry.name, entry.reclaim)

    # ------------------------------------------------------------- lookups

    @property
    def page_size(self) -> int:
        return self._view.page_size

    @property
    def pool_names(self) -> tuple[str, ...]:
        """Pools whose pages a :class:`Pin` and :meth:`publish` carry (independent pools)."""
        return self._view.alloc_names

    def _l2_run_locked(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if key not in self._entries:
                return i
        return len(keys)

    def _l3_exists(self, keys: Sequence[str]) -> int:
        """Leading run of keys whose every pool part is in L3."""
        assert self.backend is not None
        if not keys:
            return 0
        found = self.backend.exists(self._view.l3_keys(self.namespace, keys))
        return found // len(self._view.slots)

    def _scan(self, keys: Sequence[str]) -> tuple[int, int, list[int]]:
        """(L2 run, L2-or-L3 run, positions inside that run that are only in L3).

        L3 is asked in batches, only for keys not in L2, and stops at the
        first batch with a miss (the reference's batched hit query).
        """
        with self._lock:
            in_l2 = [key in self._entries for key in keys]
        l2_run = in_l2.index(False) if False in in_l2 else len(keys)
        if self.backend is None or l2_run == len(keys):
            return l2_run, l2_run, []
        only_l3: list[int] = []
        for start in range(l2_run, len(keys), self.batch_pages):
            stop = min(start + self.batch_pages, len(keys))
            need = [i for i in range(start, stop) if not in_l2[i]]
            found = self._l3_exists([keys[i] for i in need])
            only_l3.extend(need[:found])
            if found < len(need):
                return l2_run, need[found], only_l3
        return l2_run, len(keys), only_l3

    def lookup(self, keys: Sequence[str]) -> LookupResult:
        """Longest cached prefix of ``keys`` per tier. Read-only; pins nothing."""
        keys = check_keys(keys)
        l2_run, total, _ = self._scan(keys)
        self._obs.lookup(len(keys), l2_run, total - l2_run)
        return LookupResult(l2_hit_pages=l2_run, total_hit_pages=total)

    # ------------------------------------------------------------- publish

    def publish(
        self, keys: Sequence[str], pages: Mapping[str, object], *, tenant: str = ""
    ) -> npt.NDArray[np.bool_]:
        """Hand written host pages to the index under their keys.

        ``pages`` maps every independent pool (:attr:`pool_names`) to one page
        per key. Returns a mask: True = the index took the page(s) of that
        key (the caller must forget them); False = the key was already cached
        and the caller still owns its pages. Bad input (duplicate keys,
        length mismatch, unknown or missing pool, a page the index already
        owns) raises and changes nothing.
        """
        keys = check_keys(keys, unique=True)
        if not isinstance(tenant, str):
            raise InvalidArgument(f"tenant must be a str, got {tenant!r}")
        self.check_storable(keys)
        columns = check_rows(self._view, len(keys), pages)
        mask, new, hot = self._insert(keys, columns, tenant, in_l3=False, strict=True)
        self._counts["published"] += len(new)
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            self._queue_backup(new, explicit=False)
        elif self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._queue_backup(hot, explicit=False)
        else:
            self._evict_ahead()
        return mask

    def check_storable(self, keys: Sequence[str]) -> None:
        """InvalidArgument when a key's L3 name would be longer than the backend stores.

        :meth:`publish` checks it; callers that allocate or copy first call it before
        that, so a refused key changes nothing. Accepted, such a key would only fail
        later in the backup thread, once per attempt. Thread-safe (reads only).
        """
        backend = self.backend
        limit = None if backend is None else backend.max_key_bytes
        if backend is None or limit is None or not keys:
            return
        longest = max(self._view.l3_keys(self.namespace, ["x"]), key=lambda k: len(k.encode("utf-8")))
        overhead = len(longest.encode("utf-8")) - 1
        for key in keys:
            size = len(key.encode("utf-8")) + overhead
            if size > limit:
                raise InvalidArgument(
                    f"content key {key[:32]!r}... is too long: {len(key.encode('utf-8'))} bytes "
                    f"(its L3 name {size} bytes); the {backend.name!r} L3 backend stores names of "
                    f"at most {limit} bytes, i.e. keys of at most {limit - overhead} bytes here"
                )

    def _insert(
        self,
        keys: Sequence[str],
        columns: Sequence[PageArray],
        tenant: str,
        *,
        in_l3: bool,
        strict: bool,
    ) -> tuple[npt.NDArray[np.bool_], list[Entry], list[Entry]]:
        """Add entries for new keys, touch existing ones; (mask, new entries, entries now hot).

        ``columns`` holds one page array per independent pool, one page per key.
        """
        rows = list(zip(*(c.tolist() for c in columns), strict=True)) if len(keys) else []
        mask = np.zeros(len(keys), dtype=bool)
        new: list[Entry] = []
        hot: list[Entry] = []
        with self._lock:
            if self._closed or self._frozen:
                raise Unavailable("the content index is closed")
            if strict:
                for col, (owned, column) in enumerate(zip(self._owned, columns, strict=True)):
                    taken = np.flatnonzero(owned[column])
                    if taken.size:
                        i = int(taken[0])
                        raise FailedPrecondition(
                            f"page {int(column[i])} of pool {self._view.alloc_names[col]!r} already "
                            f"belongs to the content index (key {keys[i]!r} cannot take it)"
                        )
            entries = self._entries
            # Deepest key first, so the head of the prefix ends up most recent.
            for i in range(len(keys) - 1, -1, -1):
                key = keys[i]
                entry = entries.get(key)
                if entry is not None:
                    entries.move_to_end(key)
                    entry.hits += 1
                    if entry.hits >= SELECTIVE_HITS:
                        hot.append(entry)
                    continue
                entry = Entry(key, rows[i], tenant, in_l3=in_l3)
                entries[key] = entry
                mask[i] = True
                new.append(entry)
            for owned, column in zip(self._owned, columns, strict=True):
                owned[column[mask]] = True
        new.reverse()
        hot.reverse()
        return mask, new, hot

    # ------------------------------------------------------------ pin / unpin

    def pin(self, keys: Sequence[str]) -> Pin:
        """Hold the leading L2 run of ``keys`` (possibly empty) until :meth:`unpin`.

        Counts a hit on each pinned key (``write_through_selective`` backs a
        key up on its second hit) and makes it most recently used.
        """
        keys = check_keys(keys)
        with self._lock:
            if self._closed:
                raise Unavailable("the content index is closed")
            run = [self._entries[k] for k in keys[: self._l2_run_locked(keys)]]
            hot = []
            for entry in reversed(run):
                self._entries.move_to_end(entry.key)
                if entry.pins == 0:
                    self._pinned_entries += 1
                entry.pins += 1
                entry.refs += 1
                entry.hits += 1
                if entry.hits >= SELECTIVE_HITS:
                    hot.append(entry)
            pin_id = next(_PIN_IDS)
            self._pins[pin_id] = tuple(run)
        pages = {
            name: np.fromiter((e.pages[col] for e in run), dtype=np.int64, count=len(run))
            for col, name in enumerate(self._view.alloc_names)
        }
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._queue_backup(hot, explicit=False)
        return Pin(pin_id, tuple(e.key for e in run), pages)

    def unpin(self, pin: Pin) -> None:
        """Release a pin, exactly once (FailedPrecondition the second time).

        After :meth:`close` the pages are already freed and this is a no-op.
        """
        with self._lock:
            if self._closed:
                return
            entries = self._pins.get(pin.id)
            if entries is None or tuple(e.key for e in entries) != pin.keys:
                raise FailedPrecondition(f"pin {pin.id} is not held by this index (released twice?)")
            del self._pins[pin.id]
            self._drop_refs_locked(entries, pinned=True)

    def _drop_refs_locked(self, entries: Iterable[Entry], *, pinned: bool) -> None:
        doomed = []
        for entry in entries:
            entry.refs -= 1
            if pinned:
                entry.pins -= 1
                if entry.pins == 0:
                    self._pinned_entries -= 1
            if entry.refs == 0 and entry.detached:
                doomed.append(entry)
        self._free_locked(doomed)

    def _free_locked(self, entries: Sequence[Entry]) -> int:
        """Return entries' pages to their allocators (exactly once) and forget them."""
        if not entries:
            return 0
        for entry in entries:
            assert not entry.freed, f"entry {entry.key!r} freed twice"
            entry.freed = True
        for col, (allocator, owned) in enumerate(zip(self._view.allocators, self._owned, strict=True)):
            pages = np.fromiter((e.pages[col] for e in entries), dtype=np.int64, count=len(entries))
            owned[pages] = False
            allocator.free(pages)
        return len(entries)

    # ------------------------------------------------------------- eviction

    def _reclaim_callback(self, pool: str, previous: Callable[[int], int] | None, pages_needed: int) -> int:
        freed = self.reclaim(pool, pages_needed)
        if freed < pages_needed and previous is not None:
            freed += previous(pages_needed - freed)
        return freed

    def _reclaimable_callback(
        self,
        pool: str,
        previous: Callable[[int], int] | None,
        previous_estimate: Callable[[int], int] | None,
        wanted: int,
    ) -> int:
        able = self.reclaimable(pool, wanted)
        if able < wanted and previous is not None:
            able += wanted - able if previous_estimate is None else previous_estimate(wanted - able)
        return able

    def reclaimable(self, pool: str, wanted: int) -> int:
        """How many of ``wanted`` pages of ``pool`` :meth:`reclaim` could free now (evicts nothing).

        Counts unreferenced entries from the LRU end, stopping at ``wanted``
        (each entry holds one page of every independent pool).
        """
        self._view.column(pool)
        with self._lock:
            if self._closed or self._frozen:
                return 0
            able = 0
            for entry in self._entries.values():
                if able >= wanted:
                    break
                if entry.refs == 0:
                    able += 1
            return able

    def reclaim(self, pool: str, pages_needed: int) -> int:
        """Evict least recently used unreferenced entries until ``pages_needed`` pages of
        ``pool`` are free again; returns the pages of ``pool`` freed (0 when
        everything is pinned). All pools of an entry are freed together.

        Under ``write_back`` an evicted entry not yet in L3 is written there
        first, synchronously (that is the policy: the only copy is about to
        go); a failed batch drops the rest.
        """
        self._view.column(pool)  # NotFound for a pool outside the group
        if isinstance(pages_needed, bool) or not isinstance(pages_needed, int) or pages_needed < 0:
            raise InvalidArgument(f"pages_needed must be a non-negative int, got {pages_needed!r}")
        with self._lock:
            if self._closed or self._frozen:
                return 0
            victims: list[Entry] = []
            for entry in self._entries.values():
                if len(victims) >= pages_needed:
                    break
                if entry.refs == 0:
                    victims.append(entry)
            for entry in victims:
                del self._entries[entry.key]
                entry.detached = True
                entry.refs += 1  # ours until freed below
        if not victims:
            return 0
        if self.write_policy is WritePolicy.WRITE_BACK and self.backend is not None:
            self._write_back_now([e for e in victims if not e.in_l3])
        with self._lock:
            self._drop_refs_locked(victims, pinned=False)
            self._counts["evicted"] += len(victims)
        self._obs.evicted("l2", "lru", len(victims))
        if self.write_policy is WritePolicy.WRITE_BACK:
            self._evict_ahead()
        return len(victims)

    # ------------------------------------------------------------- prefetch

    def _alloc_rows(self, n: int) -> list[PageArray] | None:
        """``n`` pages of every independent pool, or None and nothing (the group's one
        allocation path: it evicts only when all of them will then fit)."""
        got = self._view.group.allocate(dict.fromkeys(self._view.alloc_names, n))
        return [got.pages[name] for name in self._view.alloc_names] if got.ok else None

    def _fetch_batch(self, tenant: str, keys: Sequence[str], discard: Callable[[], bool]) -> tuple[int, bool]:
        """L3 -> fresh L2 pages -> published; (keys now in L2, whole batch succeeded)."""
        assert self.backend is not None
        columns = self._alloc_rows(len(keys))
        if columns is None:
            return 0, False
        rows = list(zip(*(c.tolist() for c in columns), strict=True))
        good = 0
        mask = np.zeros(0, dtype=bool)
        try:
            started = time.perf_counter()
            results = self.backend.get_into(self._view.l3_keys(self.namespace, keys), self._view.chunks(rows))
            seconds = time.perf_counter() - started
            ok = self._view.whole_keys(results)
            good = ok.index(False) if False in ok else len(ok)
            if not discard():
                mask, _, _ = self._insert(
                    keys[:good], [c[:good] for c in columns], tenant, in_l3=True, strict=False
                )
        finally:
            keep = np.zeros(len(keys), dtype=bool)
            keep[: mask.size] = mask
            for allocator, column in zip(self._view.allocators, columns, strict=True):
                if (~keep).any():
                    allocator.free(column[~keep])
        if mask.size == 0:
            return 0, False
        self._counts["prefetched"] += int(mask.sum())
        self._obs.prefetched(good, good * self._view.key_bytes, seconds)
        return good, good == len(keys)

    def prefetch(
        self,
        keys: Sequence[str],
        *,
        policy: PrefetchPolicy | str,
        timeout_s: float | None = None,
        tenant: str = "",
    ) -> PrefetchTask:
        """Start copying the keys' leading L3 run that is not in L2 into L2, in the background.

        The plan is fixed here (one batched hit query); each landed batch is
        published at once, so other workers can use it before the prefetch
        ends. ``timeout_s`` overrides the reference deadline
        (:func:`prefetch_deadline_s` over the planned tokens); it only
        matters for the ``timeout`` policy.
        """
        keys = check_keys(keys)
        try:
            policy = PrefetchPolicy(policy)
        except ValueError:
            raise InvalidArgument(
                f"unknown prefetch policy {policy!r}; use one of {[p.value for p in PrefetchPolicy]}"
            ) from None
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidArgument(f"prefetch timeout must be > 0 seconds, got {timeout_s!r}")
        if self._closed:
            raise Unavailable("the content index is closed")
        plan: list[str] = []
        if self.backend is not None:
            _, _, only_l3 = self._scan(keys)
            plan = [keys[i] for i in only_l3]
        if timeout_s is None:
            tokens = len(plan) * self.page_size
            timeout_s = prefetch_deadline_s(tokens, self._timeout_base, self._timeout_per_1k)
        task = PrefetchTask(
            uuid.uuid4().hex,
            plan,
            policy=policy,
            timeout_s=timeout_s,
            batch_pages=self.batch_pages,
            fetch=functools.partial(self._fetch_batch, tenant),
        )
        with self._lock:
            self._prefetches[task.id] = task
            self._prefetch_tenant[task.id] = tenant
            self._forget_finished_locked()
        if plan:
            self._io.submit(task, IoPriority.PREFETCH)
        return task

    def _forget_finished_locked(self) -> None:
        finished = [tid for tid, t in self._prefetches.items() if t.finished]
        for tid in finished[: max(0, len(finished) - self._max_finished)]:
            del self._prefetches[tid]
            del self._prefetch_tenant[tid]

    def get_prefetch(self, prefetch_id: str) -> PrefetchTask:
        """A prefetch by id (the last ``max_finished_prefetches`` finished ones are kept)."""
        with self._lock:
            task = self._prefetches.get(prefetch_id)
        if task is None:
            raise NotFound(f"prefetch {prefetch_id!r} is unknown (or finished long ago)")
        return task

    def fetch_into_l2(self, keys: Sequence[str], *, tenant: str = "") -> int:
        """Synchronously copy L3-only keys of the cached prefix into L2; the L2 run after.

        For a GetPages with ``include_l3``: the caller pins right after. Stops at
        the first batch that cannot be fetched whole.
        """
        keys = check_keys(keys)
        if self.backend is not None:
            _, _, only_l3 = self._scan(keys)
            wanted = [keys[i] for i in only_l3]
            for batch in batches(wanted, self.batch_pages):
                _, ok = self._fetch_batch(tenant, batch, lambda: False)
                if not ok:
                    break
        with self._lock:
            return self._l2_run_locked(keys)

    # ---------------------------------------------------------- maintenance

    def clear(self, tenant: str | None = None) -> tuple[int, int]:
        """Drop every entry (or one tenant's) from L2 and L3; (L2 keys dropped, L3 keys deleted).

        Both counts are content keys (each is one page per pool of the group).

        Pinned entries leave the index now and their pages are freed at their
        last unpin. Running prefetches of the tenant are cancelled first.
        Without a tenant, the namespace's whole L3 prefix is deleted; with
        one, the L3 objects of keys this index knows the tenant wrote (L3
        keys are content hashes, so a tenant's pages written by an earlier
        daemon are only reachable by a full clear).
        """
        if tenant is not None and not isinstance(tenant, str):
            raise InvalidArgument(f"tenant must be a str or None, got {tenant!r}")
        with self._lock:
            tasks = [
                t
                for tid, t in self._prefetches.items()
                if tenant is None or self._prefetch_tenant[tid] == tenant
            ]
        for task in tasks:
            task.cancel()
        with self._lock:
            targets = [e for e in self._entries.values() if tenant is None or e.tenant == tenant]
            for entry in targets:
                del self._entries[entry.key]
                entry.detached = entry.cleared = True
            self._free_locked([e for e in targets if e.refs == 0])
            if tenant is None:
                l3_keys: set[str] = set()
                self._l3_tenant_keys.clear()
            else:
                l3_keys = self._l3_tenant_keys.pop(tenant, set())
                l3_keys.update(e.key for e in targets if e.in_l3)
        if targets:
            self._obs.evicted("l2", "clear", len(targets))
        deleted = 0
        if self.backend is not None:
            if tenant is None:
                deleted = self.backend.clear(f"{self.namespace}/")
            elif l3_keys:
                deleted = self.backend.delete(self._view.l3_keys(self.namespace, sorted(l3_keys)))
            # The backend counts objects: one per pool of each key.
            deleted = -(-deleted // len(self._view.slots))
            if deleted:
                self._obs.evicted("l3", "clear", deleted)
        return len(targets), deleted

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                entries=len(self._entries),
                pinned_entries=self._pinned_entries,
                l3_resident_entries=sum(e.in_l3 for e in self._entries.values()),
                queued_backup_pages=self._queued_pages,
                running_prefetches=sum(not t.finished for t in self._prefetches.values()),
                published_pages=self._counts["published"],
                evicted_pages=self._counts["evicted"],
                backed_up_pages=self._counts["backed_up"],
                backup_failed_pages=self._counts["backup_failed"],
                prefetched_pages=self._counts["prefetched"],
                dropped_backup_pages=self._counts["dropped_backup"],
            )

    def owned_pages(self) -> dict[str, PageArray]:
        """Every page the index owns now, per independent pool (a copy)."""
        with self._lock:
            return {
                name: np.flatnonzero(owned).astype(np.int64)
                for name, owned in zip(self._view.alloc_names, self._owned, strict=True)
            }

    # ---------------------------------------------------------- warm restart

    def export_entries(self) -> list[EntryRecord]:
        """Freeze the index and return its entries, least recently used first (a journal's content).

        Background I/O stops first (queued backups are dropped, prefetches
        cancelled: :meth:`flush` before to keep them), so no page of a
        returned entry can change or be recycled after the snapshot; from
        then on the index takes no new entries and evicts nothing. Pinned
        entries are included (their pages are the index's). Call
        :meth:`close` afterwards: it still frees every page in this process.
        Unavailable after :meth:`close`.
        """
        self._stop_io()
        with self._lock:
            if self._closed:
                raise Unavailable("the content index is closed")
            self._frozen = True
            names = self._view.alloc_names
            return [
                EntryRecord(e.key, dict(zip(names, e.pages, strict=True)), e.tenant, e.in_l3)
                for e in self._entries.values()
            ]

    def restore(self, records: Sequence[EntryRecord]) -> int:
        """Re-install journaled entries (least recently used first) into an empty index.

        Each record's pages are marked allocated in their pools (exactly once)
        and owned by the index, as if published; its tenant and L3 flag are
        kept. Under ``write_through`` the entries not yet in L3 are queued for
        backup. Returns the entries restored. Validates everything first:
        InvalidArgument for a bad record, FailedPrecondition when the index
        already holds entries or a page is already allocated; nothing changes then.
        Call it before any session can reach the group (the registry does).
        """
        records = list(records)
        with self._lock:
            if self._closed or self._frozen:
                raise Unavailable("the content index is closed")
            if self._entries:
                raise FailedPrecondition(
                    f"restore needs an empty index; it holds {len(self._entries)} entries"
                )
        columns = check_records(self._view, records)
        marked: list[tuple[PageAllocator, PageArray]] = []
        try:
            for allocator, column in zip(self._view.allocators, columns, strict=True):
                allocator.mark_allocated(column)
                marked.append((allocator, column))
        except BaseException:
            for allocator, column in marked:
                allocator.free(column)
            raise
        restored = [
            Entry(r.key, tuple(int(c[i]) for c in columns), r.tenant, in_l3=r.in_l3)
            for i, r in enumerate(records)
        ]
        with self._lock:
            for entry in restored:
                self._entries[entry.key] = entry
            for owned, column in zip(self._owned, columns, strict=True):
                owned[column] = True
            self._counts["restored"] += len(restored)
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            self._queue_backup([e for e in restored if not e.in_l3], explicit=False)
        return len(restored)

    def _stop_io(self) -> None:
        with self._lock:
            tasks = list(self._prefetches.values())
        for task in tasks:
            task.cancel()
        self._io.close()

    def close(self) -> None:
        """Stop I/O (queued backups are dropped: call :meth:`flush` first to keep them),
        free every page the index owns, pinned or not, exactly once, and give the
        pools their previous reclaim callbacks back. Idempotent; outstanding
        pins become no-ops.
        """
        with self._lock:
            if self._closed:
                return
        self._stop_io()
        with self._lock:
            self._closed = True
            alive = list(self._entries.values())
            self._entries.clear()
            for entries in self._pins.values():
                alive.extend(e for e in entries if e.detached and not e.freed)
            self._pins.clear()
            unique = list({id(e): e for e in alive if not e.freed}.values())
            self._free_locked(unique)
            self._idle.notify_all()
        for entry in self._view.group.entries:
            if entry.name in self._previous_reclaim:
                entry.reclaim = self._previous_reclaim[entry.name]
                entry.reclaimable = self._previous_reclaimable[entry.name]

    def __enter__(self) -> ContentIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
