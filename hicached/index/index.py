"""The content index: content key -> host (L2) pages, plus L3 backup and prefetch.

One :class:`ContentIndex` serves one host pool group, i.e. one model/layout
namespace shared by every worker attached to it: a page one worker published
can be pinned and loaded by another (worker B reuses worker A's prefix).
Tenants never match because their key chains are seeded differently
(:func:`hicached.page_keys.page_keys`); each entry also keeps its tenant label
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
only when it is evicted, and that write is never on a worker's allocation
path: the index evicts ahead of need in the background whenever a pool's
free share drops below ``write_back_free_fraction``, a reclaim evicts only
entries L3 already holds, and a reclaim short of those starts the others'
eviction in the background (the allocation fails meanwhile). The reference
writes them synchronously; here a hung L3 would then hold the group's lock.

Rooms: :class:`ContentIndex` is a facade over the :class:`EntryTable`
(entries, pins, owned pages: the state and its lock), the :class:`Writer`
(L2 -> L3, with its bounded :class:`~hicached.index.backup.BackupQueue`) and
the :class:`Prefetcher` (L3 -> L2), which share one :class:`IoScheduler`.

Thread-safety: every public method may be called from any thread. The
table's lock guards the entries; it is never held during L3 I/O, nor while
calling into the pool group. The index registers itself as the group's
:class:`~hicached.l2.group.Reclaimer` (and unregisters on close); the group
calls :meth:`ContentIndex.reclaim` with its own lock held, so the order is
always group lock -> table lock -> backup queue lock (or the shared ``tenant_keys``' lock).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

import numpy as np
import numpy.typing as npt

from hicached.errors import InvalidArgument, Unavailable
from hicached.index.entries import EntryRecord, check_keys, check_records, check_rows
from hicached.index.jobs import IoPriority, IoScheduler, PrefetchTask
from hicached.index.observer import IndexObserver, NullIndexObserver
from hicached.index.pools import FreePages, GroupView
from hicached.index.prefetch import Prefetcher
from hicached.index.table import EntryTable
from hicached.index.tenant_keys import TenantL3Keys
from hicached.index.types import (
    BackupResult,
    IndexOptions,
    IndexStats,
    LookupResult,
    Pin,
    PrefetchPolicy,
    WritePolicy,
    prefetch_deadline_s,
)
from hicached.index.writer import Writer
from hicached.l2.allocator import PageAllocator, PageArray
from hicached.l2.group import HostPoolGroup
from hicached.l3.base import StorageBackend

__all__ = ["ContentIndex"]

_DEFAULT_OPTIONS = IndexOptions()


class ContentIndex:
    """Content key -> L2 pages of one host pool group, with L3 behind it.

    See the module docstring for ownership, eviction and locking. Configuration errors raise
    :class:`~hicached.errors.InvalidArgument`; nothing is installed then. A group has one
    index: AlreadyExists while another is open on it. ``tenant_keys``: the daemon's store of
    tenant keys written to L3, shared by all groups' indexes (the index's own when not given).
    ``options``: the tunables (:class:`~hicached.index.types.IndexOptions`, validated there).
    """

    def __init__(
        self,
        group: HostPoolGroup,
        *,
        namespace: str,
        backend: StorageBackend | None,
        options: IndexOptions = _DEFAULT_OPTIONS,
        observer: IndexObserver | None = None,
        tenant_keys: TenantL3Keys | None = None,
        free_pages: FreePages | None = None,
    ) -> None:
        if not isinstance(namespace, str) or not namespace or namespace.endswith("/"):
            raise InvalidArgument(f"namespace must be a non-empty str not ending in '/', got {namespace!r}")
        self.write_policy = WritePolicy(options.write_policy)  # a WritePolicy already (IndexOptions)
        self.namespace = namespace
        self.backend = backend
        self.batch_pages = options.batch_pages
        self._view = GroupView(group, free_pages)  # see GroupView for ``free_pages``
        self._obs: IndexObserver = observer if observer is not None else NullIndexObserver()
        self._timeout_base = options.prefetch_timeout_base_s
        self._timeout_per_1k = options.prefetch_timeout_per_1k_tokens_s
        self._table = EntryTable(self._view, tenant_keys)
        self._writer = Writer(
            self._table,
            self._view,
            backend=backend,
            namespace=namespace,
            policy=self.write_policy,
            max_queued_pages=options.max_queued_pages,
            batch_pages=options.batch_pages,
            free_fraction=options.write_back_free_fraction,
            observer=self._obs,
            submit=lambda job: self._io.submit(job, IoPriority.BACKUP),
        )
        self._prefetcher = Prefetcher(
            self._table,
            self._view,
            backend=backend,
            namespace=namespace,
            batch_pages=options.batch_pages,
            max_finished=options.max_finished_prefetches,
            observer=self._obs,
            submit=lambda task: self._io.submit(task, IoPriority.PREFETCH),
        )
        self._io = IoScheduler(options.io_workers, f"hicache-{namespace}")
        # Registered last: from here on the group may call reclaim/reclaimable.
        try:
            group.register_reclaimer(self)
        except BaseException:
            self._io.close()
            raise

    # ------------------------------------------------------------- lookups

    @property
    def page_size(self) -> int:
        return self._view.page_size

    @property
    def pool_names(self) -> tuple[str, ...]:
        """Pools whose pages a :class:`Pin` and :meth:`publish` carry (independent pools)."""
        return self._view.alloc_names

    def _scan(self, keys: Sequence[str]) -> tuple[int, int, list[int]]:
        """(L2 run, L2-or-L3 run, positions inside that run that are only in L3).

        L3 is asked in batches, only for keys not in L2, and stops at the
        first batch with a miss (the reference's batched hit query).
        """
        in_l2 = self._table.resident(keys)
        l2_run = in_l2.index(False) if False in in_l2 else len(keys)
        if self.backend is None or l2_run == len(keys):
            return l2_run, l2_run, []
        only_l3: list[int] = []
        for start in range(l2_run, len(keys), self.batch_pages):
            stop = min(start + self.batch_pages, len(keys))
            need = [i for i in range(start, stop) if not in_l2[i]]
            found = self._view.l3_run(self.backend, self.namespace, [keys[i] for i in need])
            only_l3.extend(need[:found])
            if found < len(need):
                return l2_run, need[found], only_l3
        return l2_run, len(keys), only_l3

    def lookup(self, keys: Sequence[str], *, per_key: bool = False) -> LookupResult:
        """Longest cached prefix of ``keys`` per tier; with ``per_key`` also each key's flags
        (L3 is asked for every key not in L2, after a miss too). Read-only; pins nothing."""
        keys = check_keys(keys)
        if per_key:
            in_l2 = self._table.resident(keys)
            cached = self._view.cached(self.backend, self.namespace, keys, in_l2)
            result = LookupResult.of_flags(in_l2, cached)
        else:
            l2_run, total, _ = self._scan(keys)
            result = LookupResult(l2_hit_pages=l2_run, total_hit_pages=total)
        self._obs.lookup(len(keys), result.l2_hit_pages, result.total_hit_pages - result.l2_hit_pages)
        return result

    def l2_resident(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key: resident in L2. Asks no L3, counts no lookup."""
        return self._table.resident(check_keys(keys))

    # ------------------------------------------------------------- publish / pin

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
        mask, new, hot = self._table.insert(keys, columns, tenant, in_l3=False, strict=True)
        self._writer.published(new, hot)
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
        prefix = max(self._view.l3_keys(self.namespace, [""]), key=backend.name_bytes)  # longest pool's
        for key in keys:
            size = backend.name_bytes(prefix + key)
            if size > limit:
                raise InvalidArgument(
                    f"content key {key[:32]!r}... is too long: {len(key.encode('utf-8'))} bytes, its L3 name "
                    f"{size} bytes; the {backend.name!r} L3 backend stores names of at most {limit} bytes"
                )

    def pin(self, keys: Sequence[str]) -> Pin:
        """Hold the leading L2 run of ``keys`` (possibly empty) until :meth:`unpin`.

        Counts a hit on each pinned key (``write_through_selective`` backs a
        key up on its second hit) and makes it most recently used.
        """
        pin, hot = self._table.pin(check_keys(keys))
        self._writer.pinned(hot)
        return pin

    def unpin(self, pin: Pin) -> None:
        """Release a pin, exactly once (FailedPrecondition the second time).

        After :meth:`close` the pages are already freed and this is a no-op.
        """
        self._table.unpin(pin)

    # ------------------------------------------------------------- eviction (the group's Reclaimer)

    def reclaimable(self, pool: str, wanted: int) -> int:
        """How many of ``wanted`` pages of ``pool`` :meth:`reclaim` could free now.

        Counts unreferenced entries from the LRU end, stopping at ``wanted``
        (each entry holds one page of every independent pool); under ``write_back``
        only those L3 holds, and a shortfall starts the others' way to L3 in the
        background (see :meth:`reclaim`).
        """
        self._view.column(pool)
        return self._writer.reclaimable(wanted)

    def leaving(self, pool: str) -> int:
        """Pages of ``pool`` the write-back eviction in flight frees once written (one per entry)."""
        self._view.column(pool)
        return self._writer.queue.evicting()

    def reclaim(self, pool: str, pages_needed: int) -> int:
        """Evict least recently used unreferenced entries until ``pages_needed`` pages of
        ``pool`` are free again; returns the pages of ``pool`` freed (0 when
        everything is pinned). All pools of an entry are freed together.

        Under ``write_back`` only entries L3 already holds are evicted here: an entry
        whose only copy is in L2 is written to L3 first, in the background (the
        eviction ahead of need), and its pages are freed once it is; an allocation
        never waits for L3.
        """
        self._view.column(pool)  # NotFound for a pool outside the group
        if isinstance(pages_needed, bool) or not isinstance(pages_needed, int) or pages_needed < 0:
            raise InvalidArgument(f"pages_needed must be a non-negative int, got {pages_needed!r}")
        return self._writer.reclaim(pages_needed)

    # ------------------------------------------------------------- L3: backup and prefetch

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
        return self._writer.backup(check_keys(keys), wait=wait, timeout_s=timeout_s)

    def flush(self, timeout_s: float | None = None) -> int:
        """Wait until no backup is queued; returns pages stored meanwhile.

        Under ``write_back`` and ``write_through`` every entry not yet in L3 is
        queued first, in chunks that fit the queue (a drain before shutdown must
        not lose the only copy, nor leave out what an L3 outage failed to write).
        Raises ResourceExhausted if the queue is still busy at ``timeout_s``, and
        Unavailable if a backup failed meanwhile (L3 lacks pages it should hold).
        """
        return self._writer.flush(timeout_s)

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
        if self._table.closed:
            raise Unavailable("the content index is closed")
        plan: list[str] = []
        if self.backend is not None:
            _, _, only_l3 = self._scan(keys)
            plan = [keys[i] for i in only_l3]
        if timeout_s is None:
            tokens = len(plan) * self.page_size
            timeout_s = prefetch_deadline_s(tokens, self._timeout_base, self._timeout_per_1k)
        return self._prefetcher.start(plan, policy=policy, timeout_s=timeout_s, tenant=tenant)

    def get_prefetch(self, prefetch_id: str) -> PrefetchTask:
        """A prefetch by id (the last ``max_finished_prefetches`` finished ones are kept)."""
        return self._prefetcher.get(prefetch_id)

    def kept_prefetches(self, prefetch_ids: Set[str]) -> set[str]:
        """Those of ``prefetch_ids`` this index still keeps (running, or recently finished)."""
        return self._prefetcher.kept(prefetch_ids)

    def running_prefetches(self, prefetch_ids: Set[str]) -> int:
        """How many of ``prefetch_ids`` are running or queued."""
        return self._prefetcher.running(prefetch_ids)

    def fetch_into_l2(self, keys: Sequence[str], *, tenant: str = "") -> int:
        """Synchronously copy L3-only keys of the cached prefix into L2; the L2 run after.

        For a GetPages with ``include_l3``: the caller pins right after. Stops at
        the first batch that cannot be fetched whole.
        """
        keys = check_keys(keys)
        if self.backend is None:
            return self._table.l2_run(keys)
        l2_run, _, only_l3 = self._scan(keys)
        if not only_l3:
            return l2_run  # nothing to fetch (a warm GetPages): no second pass over the keys
        self._prefetcher.fetch_now([keys[i] for i in only_l3], tenant)
        return self._table.l2_run(keys)

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
        self._prefetcher.cancel(tenant)
        dropped, l3_keys, began = self._table.detach(tenant)
        if not began:
            return 0, 0  # nothing of the tenant's here: no epoch moved, no delete to run
        if dropped:
            self._obs.evicted("l2", "clear", dropped)
        deleted = 0
        try:  # until end_clear, an L3 read publishes nothing (it may read what is being deleted)
            if self.backend is not None:
                if l3_keys is None:
                    deleted = self.backend.clear(f"{self.namespace}/")
                elif l3_keys:
                    deleted = self.backend.delete(self._view.l3_keys(self.namespace, sorted(l3_keys)))
                self._table.forget_l3(l3_keys)  # only once deleted: a failed clear can be retried
                # The backend counts objects: one per pool of each key.
                deleted = -(-deleted // len(self._view.slots))
                if deleted:
                    self._obs.evicted("l3", "clear", deleted)
        finally:
            self._table.end_clear([tenant])
        return dropped, deleted

    def stats(self, tenant: str | None = None) -> IndexStats:
        """Counters of the index (each room's read atomically, in turn); ``tenant``: count its entries only."""
        entries, pinned, in_l3, totals = self._table.sizes(tenant)
        backups = self._writer.counts()
        return IndexStats(
            entries=entries,
            pinned_entries=pinned,
            l3_resident_entries=in_l3,
            queued_backup_pages=backups.queued,
            running_prefetches=self._prefetcher.running(),
            published_pages=totals.get("published", 0),
            evicted_pages=totals.get("evicted", 0),
            backed_up_pages=backups.backed_up,
            backup_failed_pages=backups.failed,
            prefetched_pages=totals.get("prefetched", 0),
            dropped_backup_pages=backups.dropped,
        )

    def owned_pages(self) -> dict[str, PageArray]:
        """Every page the index owns now, per independent pool (a copy)."""
        return self._table.owned_pages()

    # ---------------------------------------------------------- warm restart

    def export_entries(self) -> list[EntryRecord]:
        """Freeze the index and return its entries, least recently used first (a journal's content).

        Background I/O stops first (queued backups dropped, prefetches cancelled: :meth:`flush`
        before to keep them), not waiting for an L3 call in flight (a stalled store holds it);
        the index then takes no new entries and evicts nothing, so no returned entry's page
        changes after the snapshot. Pinned entries are included. :meth:`close` afterwards waits
        for those calls and frees every page in this process. Unavailable after :meth:`close`.
        """
        self._prefetcher.cancel(wait=False)
        self._io.stop()
        return self._table.freeze()

    def restore(self, records: Sequence[EntryRecord]) -> int:
        """Re-install journaled entries (least recently used first) into an empty index.

        Each record's pages are marked allocated in their pools (exactly once) and owned by the
        index, as if published; its tenant and L3 flag are kept. Under ``write_through`` the
        entries not yet in L3 are queued for backup. Returns the entries restored. Validates
        everything first: InvalidArgument for a bad record, FailedPrecondition when the index already
        holds entries or a page is already allocated; nothing changes then. Call it before any
        session can reach the group (the registry does).
        """
        records = list(records)
        self._table.check_empty()
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
        restored = self._table.install(records, columns)
        self._writer.restored(restored)
        return len(restored)

    def _stop_io(self) -> None:
        self._prefetcher.cancel()
        self._io.close()

    def close(self) -> None:
        """Stop I/O (queued backups are dropped: call :meth:`flush` first to keep them),
        free every page the index owns, pinned or not, exactly once, and stop being
        the group's reclaimer. Idempotent; outstanding pins become no-ops.
        """
        if self._table.closed:
            return
        self._stop_io()
        self._table.close()
        self._writer.queue.wake()
        self._view.group.unregister_reclaimer(self)

    def __enter__(self) -> ContentIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
