"""A worker's host pools as one group: an anchor plus sidecars (SGLang's HostPoolGroup).

The **anchor** is the main KV pool; it decides the primary host indices.
**Sidecars** (SWA, Mamba state, draft KV, indexer, ...) allocate their own
pages. A **derived** sidecar allocates nothing: it reuses the pages of another
pool (``indices_from_pool``), so it is skipped on release and every allocation
is freed exactly once. Each entry maps global layer ids to its own layers and
may pack draft (MTP) layers after its target layers.

A new pool type is a new :class:`PoolEntry` in the group, never a new field on
whatever drives the group.

Differences from the reference (sglang ``pool_host/group.py``), on purpose:

* transfers are processed sorted by pool name (same order on every TP rank,
  as the design asks); results come back in input order;
* inputs are never mutated: :class:`ResolveResult` carries copies (the
  reference writes into the transfers and resets them on rollback); an empty
  list resolves to ``ok`` with no transfers (the reference returns None);
* ``release_transfers`` frees a transfer only if ``host_allocated`` says this
  group allocated it; the reference frees every non-derived transfer that has
  host indices, which double-frees indices a caller set itself;
* derivation can be declared once on the entry (``PoolEntry.indices_from_pool``)
  as well as per transfer (``PoolTransfer.indices_from_pool``, the reference's);
* one allocation path (:meth:`HostPoolGroup.allocate`) serves every caller:
  it computes each pool's shortfall and asks the group's :class:`Reclaimer`
  whether it can free that much before evicting anything, so a request that
  cannot fit evicts nothing (the reference reclaims pool by pool and may
  evict for a request that then fails);
* the evictor is one explicit :class:`Reclaimer` registered with the group
  (:meth:`HostPoolGroup.register_reclaimer`), not a callback per pool entry
  that another layer patches in and restores;
* bad input (duplicate transfer names, malformed indices, unknown pools on
  release) raises before anything changes. ``resolve_host_transfers`` keeps
  the reference's rule of skipping transfers for unknown pools;
  :meth:`HostPoolGroup.resolve_all`, the daemon's entry point, rejects them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from hicached.errors import AlreadyExists, InvalidArgument, NotFound, clip
from hicached.l2.allocator import ANYONE, PageArray, PagesLike, as_page_array
from hicached.l2.group_types import (
    Allocation,
    LayerMapper,
    LayerRoute,
    PoolEntry,
    PoolTransfer,
    Reclaimer,
    ResolveResult,
    check_new_entry,
    copy_indices,
    identity_layers,
    layer_map,
    layer_range,
)
from hicached.l2.host_pool import HostKVPool

# The group's vocabulary is importable from here too (its long-standing home).
__all__ = [
    "Allocation",
    "HostPoolGroup",
    "LayerMapper",
    "LayerRoute",
    "PoolEntry",
    "PoolTransfer",
    "Reclaimer",
    "ResolveResult",
    "identity_layers",
    "layer_map",
    "layer_range",
]

logger = logging.getLogger(__name__)


class HostPoolGroup:
    """An anchor pool and its sidecars, allocated atomically.

    Thread-safety: one re-entrant lock serialises every allocation, rollback
    and release of the group (its :class:`Reclaimer` runs under it).
    Atomicity: a resolve either allocates everything it needs or nothing; a
    release either frees every owned transfer or raises and frees nothing.
    Ownership: the group owns its pools (``close`` closes them); every
    transfer and index array it returns is a fresh copy owned by the caller.
    Pages of group pools must be freed through the group (or its pools'
    allocators from within a reclaim callback), never behind its back while
    a release is validating.
    """

    def __init__(self, entries: Sequence[PoolEntry] = ()) -> None:
        self._lock = threading.RLock()
        self._entries: dict[str, PoolEntry] = {}
        self._anchor: PoolEntry | None = None
        self._reclaimer: Reclaimer | None = None
        names = [e.name for e in entries]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise AlreadyExists(f"host pool {clip(dup)} is listed twice")
        anchors = [e.name for e in entries if e.is_primary_index_anchor]
        if len(anchors) > 1:
            raise AlreadyExists(f"a group has one anchor; {anchors} are all marked as anchor")
        # The anchor first, then independent pools, then derived ones: each is
        # validated against the entries before it.
        for entry in sorted(
            entries, key=lambda e: (not e.is_primary_index_anchor, e.indices_from_pool is not None)
        ):
            self.add_entry(entry)

    # ---- membership -------------------------------------------------------

    def add_entry(self, entry: PoolEntry) -> None:
        """Register a pool. The first entry (or the one marked) is the anchor, fixed for life."""
        with self._lock:
            check_new_entry(entry, self._entries, self._anchor)
            self._entries[entry.name] = entry
            if self._anchor is None:
                self._anchor = entry

    def get_entry(self, name: str) -> PoolEntry:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise NotFound(
                f"host pool {clip(name)} is not in this group (known: {sorted(self._entries)})"
            ) from None

    def get_pool(self, name: str) -> HostKVPool:
        return self.get_entry(name).host_pool

    @property
    def anchor(self) -> PoolEntry:
        if self._anchor is None:
            raise NotFound("the host pool group is empty: it has no anchor")
        return self._anchor

    @property
    def entries(self) -> list[PoolEntry]:
        with self._lock:
            return [self._entries[n] for n in sorted(self._entries)]

    # ---- reclaimer -----------------------------------------------------------

    def register_reclaimer(self, reclaimer: Reclaimer) -> None:
        """Make ``reclaimer`` the group's evictor (see :class:`Reclaimer` for when it is called).

        One at a time: AlreadyExists while another one is registered. Thread-safe.
        """
        with self._lock:
            if self._reclaimer is not None and self._reclaimer is not reclaimer:
                raise AlreadyExists("the host pool group already has a reclaimer (a content index)")
            self._reclaimer = reclaimer

    def unregister_reclaimer(self, reclaimer: Reclaimer) -> None:
        """Stop asking ``reclaimer`` (a no-op unless it is the registered one). Thread-safe;
        once it returns, no allocation is calling ``reclaimer`` any more."""
        with self._lock:
            if self._reclaimer is reclaimer:
                self._reclaimer = None

    # ---- single-pool allocation --------------------------------------------

    def alloc(self, n: int, *, pool: str | None = None, reclaim: bool = False) -> PageArray | None:
        """``n`` pages of one pool (the anchor by default), or None if no room.

        With ``reclaim`` the group's reclaimer may evict for it, under the
        rules of :meth:`allocate`; without, nothing is evicted.
        """
        entry = self.anchor if pool is None else self.get_entry(pool)
        with self._lock:
            got = self._allocate_locked({entry.name: n}, self._reclaimer if reclaim else None)
        if not got.ok:
            return None
        self._scrub(got.pages, ())
        return got.pages[entry.name]

    def allocate(
        self, needs: Mapping[str, int], *, fills: Collection[str] = (), owner: int = ANYONE
    ) -> Allocation:
        """``needs[pool]`` fresh pages of each named pool, all or nothing: the one allocation path.

        The pages come zeroed where an earlier owner's bytes may remain (in the pool and
        in every pool derived from it), except in the pools named in ``fills``: the caller
        overwrites those pages whole before anyone else can read them, or frees them.
        ``owner`` (an allocator tag, :meth:`PageAllocator.take_dirty`): its own freed pages are not.

        Pools short of room are reclaimed (the group's :class:`Reclaimer`)
        only when every pool's shortfall can be freed, as its ``reclaimable``
        reports; otherwise nothing is evicted and the result is a failure
        naming the pool. The estimate and the eviction are two
        steps: an entry pinned by another thread in between can make the
        reclaim fall short; then what this call allocated is freed and the
        result is a failure, and what was evicted stays evicted (the only
        case where a failed allocation changes the cache). Unknown pools: NotFound;
        derived pools or negative counts: InvalidArgument (nothing changes).
        Thread-safe (the group lock); the returned arrays belong to the caller.
        """
        with self._lock:
            got = self._allocate_locked(needs, self._reclaimer)
        if got.ok:
            self._scrub(got.pages, fills, owner)
        return got

    def _scrub(self, pages: Mapping[str, PageArray], fills: Collection[str], owner: int = ANYONE) -> None:
        """Zero the pages just allocated (the caller's now) that an earlier owner may have
        written, in every pool that shares them but those in ``fills``. Runs outside the
        group lock (nobody else may touch the caller's pages): zeroing a large batch must not
        hold every other session's allocations. When zeroing fails the pages are freed (their
        flags set again) and the error raised: nothing is handed out unzeroed, nothing leaks.

        Why: a freed page keeps its bytes, and the next session may be another tenant's (an Alloc,
        then Publish and GetBytes, read them back). Only pages another ``owner`` freed are written.
        """
        try:
            for name, arr in pages.items():
                dirty = self._entries[name].host_pool.allocator.take_dirty(arr, owner=owner)
                if dirty.size == 0:
                    continue
                for entry in self._entries.values():
                    shares = name in (entry.name, entry.indices_from_pool)
                    if shares and entry.name not in fills:
                        entry.host_pool.zero_pages(dirty)
        except BaseException:
            with self._lock:
                self._free_pages(pages)
            raise

    def _allocate_locked(self, needs: Mapping[str, int], reclaimer: Reclaimer | None) -> Allocation:
        wanted: dict[str, int] = {}
        for name in sorted(needs):
            entry = self.get_entry(name)
            n = needs[name]
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise InvalidArgument(
                    f"pool {clip(name)}: page count must be a non-negative integer, got {n!r}"
                )
            if entry.indices_from_pool is not None:
                raise InvalidArgument(
                    f"pool {clip(name)} is derived from {clip(entry.indices_from_pool)}: it allocates nothing"
                )
            wanted[name] = int(n)
        if any(self._entries[name].host_pool.allocator.sealed for name in wanted):  # no eviction
            return Allocation(False, reason="the pool group is closing (shutdown): it allocates no more")
        free = {name: self._entries[name].host_pool.allocator.available() for name in wanted}
        short = {name: n - free[name] for name, n in wanted.items() if n > free[name]}
        # Ask before evicting: a request that cannot fit must leave the cache untouched.
        for name, gap in short.items():
            allocator = self._entries[name].host_pool.allocator
            able = (
                0 if reclaimer is None else min(allocator.allocated_count(), reclaimer.reclaimable(name, gap))
            )
            if able < gap:
                leaving = 0 if reclaimer is None else reclaimer.leaving(name)
                soon = f", {leaving} being freed: retry shortly" if leaving else ""
                return Allocation(
                    False,
                    reason=f"pool {clip(name)}: no room for {wanted[name]} pages "
                    f"({free[name]} free, {able} reclaimable{soon})",
                )
        for name in short:  # in name order; one eviction may free pages of several pools
            gap = wanted[name] - self._entries[name].host_pool.allocator.available()
            if gap > 0 and reclaimer is not None:
                freed = reclaimer.reclaim(name, gap)
                logger.debug("pool %s: reclaim for %d pages freed %s", name, gap, freed)
        got: dict[str, PageArray] = {}
        for name, n in wanted.items():
            allocator = self._entries[name].host_pool.allocator
            pages = allocator.alloc(n)
            if pages is None:
                self._free_pages(got)
                return Allocation(
                    False,
                    reason=f"pool {clip(name)}: no room for {n} pages ({allocator.available()} free after reclaim)",
                )
            got[name] = pages
        return Allocation(True, got)

    def _free_pages(self, pages: Mapping[str, PageArray]) -> None:
        for name, arr in pages.items():
            self._entries[name].host_pool.allocator.free(arr)

    def free(self, pages: PagesLike, *, pool: str | None = None, by: int = ANYONE) -> int:
        entry = self.anchor if pool is None else self.get_entry(pool)
        with self._lock:
            return entry.host_pool.allocator.free(pages, by=by)

    def available(self, pool: str | None = None) -> int:
        entry = self.anchor if pool is None else self.get_entry(pool)
        return entry.host_pool.allocator.available()

    # ---- multi-pool transfers ----------------------------------------------

    def _derived_source(self, transfer: PoolTransfer) -> str | None:
        if transfer.indices_from_pool is not None:
            return transfer.indices_from_pool
        entry = self._entries.get(transfer.name)
        return None if entry is None else entry.indices_from_pool

    def _rollback(self, allocated: list[PoolTransfer]) -> None:
        for transfer in allocated:
            assert transfer.host_indices is not None
            self._entries[transfer.name].host_pool.allocator.free(transfer.host_indices)

    @staticmethod
    def _copies(transfers: Sequence[PoolTransfer]) -> list[PoolTransfer]:
        work = [t.copy() for t in transfers]
        seen: set[str] = set()
        for t in work:
            if t.name in seen:
                raise InvalidArgument(f"pool {clip(t.name)} appears in more than one transfer")
            seen.add(t.name)
        return work

    def resolve_host_transfers(
        self,
        transfers: Sequence[PoolTransfer],
        primary_device_indices: PagesLike | None = None,
        primary_host_indices: PagesLike | None = None,
    ) -> ResolveResult:
        """Allocate host pages for every unresolved transfer, atomically (the reference algorithm).

        In pool-name order: derived transfers wait; transfers that already have
        host indices, have no device indices, or name an unknown pool are
        skipped; every other one gets ``len(device_indices)`` fresh pages from
        one allocation (all or nothing, see :meth:`allocate`). Then derived
        transfers are bound to the primary indices (source = anchor) or to
        their source transfer's; a missing source is a failure that frees what
        this call allocated.
        """
        primary_dev = copy_indices(primary_device_indices, "primary_device_indices")
        primary_host = copy_indices(primary_host_indices, "primary_host_indices")
        work = self._copies(transfers)
        with self._lock:
            allocated: list[PoolTransfer] = []
            try:
                failure = self._resolve_locked(work, allocated, primary_dev, primary_host)
            except BaseException:
                self._rollback(allocated)
                raise
            if failure:
                self._rollback(allocated)
                return ResolveResult(False, [t.copy() for t in transfers], failure)
        self._scrub({t.name: t.host_indices for t in allocated if t.host_indices is not None}, ())
        return ResolveResult(True, work)

    def _resolve_locked(
        self,
        work: list[PoolTransfer],
        allocated: list[PoolTransfer],
        primary_dev: PageArray | None,
        primary_host: PageArray | None,
    ) -> str:
        """Run the algorithm on ``work`` in place; return a failure reason or ''."""
        derived: list[tuple[PoolTransfer, str]] = []
        todo: list[PoolTransfer] = []
        for transfer in sorted(work, key=lambda t: t.name):
            source = self._derived_source(transfer)
            if source is not None:
                derived.append((transfer, source))
            elif (
                transfer.host_indices is None
                and transfer.device_indices is not None
                and transfer.name in self._entries
            ):
                todo.append(transfer)
        got = self._allocate_locked(
            {t.name: int(t.device_indices.size) for t in todo if t.device_indices is not None},
            self._reclaimer,
        )
        if not got.ok:
            return got.reason
        for transfer in todo:
            transfer.host_indices = got.pages[transfer.name]
            transfer.host_allocated = True
            allocated.append(transfer)

        anchor_name = None if self._anchor is None else self._anchor.name
        for transfer, source_name in derived:
            transfer.host_allocated = False
            if source_name == anchor_name:
                transfer.host_indices = copy_indices(primary_host, "primary_host_indices")
                transfer.device_indices = copy_indices(primary_dev, "primary_device_indices")
                continue
            src = next((c for c in work if c.name == source_name and self._derived_source(c) is None), None)
            if src is None:
                return f"derived pool {clip(transfer.name)} needs a transfer of {clip(source_name)}; none was given"
            transfer.host_indices = copy_indices(src.host_indices, source_name)
            transfer.device_indices = copy_indices(src.device_indices, source_name)
        return ""

    def resolve_all(
        self, transfers: Sequence[PoolTransfer], *, copy_in: bool = False, owner: int = ANYONE
    ) -> ResolveResult:
        """The daemon's resolve: the anchor's transfer (if any) is the primary.

        ``copy_in``: the caller copies every transfer's device pages into its host pages
        (a Write), so only the pools without a transfer get their new pages zeroed; else
        every new page comes zeroed (see :meth:`allocate`, also for ``owner``).

        Unknown pools raise NotFound. Every missing host page (the anchor's
        and the sidecars') comes from one allocation (:meth:`allocate`'s rules), so nothing is
        evicted unless the whole batch fits; then
        :meth:`resolve_host_transfers` binds the derived transfers, with the
        anchor's pages as the primary indices. On any failure everything
        allocated here is freed.
        """
        work = self._copies(transfers)
        for t in work:
            self.get_entry(t.name)
        anchor = self.anchor
        with self._lock:
            primary = next((t for t in work if t.name == anchor.name), None)
            if primary is not None and primary.indices_from_pool is not None:
                raise InvalidArgument(
                    f"the anchor's transfer {anchor.name!r} cannot derive from {primary.indices_from_pool!r}"
                )
            todo = [
                t
                for t in work
                if self._derived_source(t) is None and t.host_indices is None and t.device_indices is not None
            ]
            got = self._allocate_locked(
                {t.name: int(t.device_indices.size) for t in todo if t.device_indices is not None},
                self._reclaimer,
            )
            if not got.ok:
                return ResolveResult(False, [t.copy() for t in transfers], got.reason)
            for t in todo:
                t.host_indices = got.pages[t.name]
                t.host_allocated = True
            # The rest of resolve_host_transfers on ``work`` itself (private copies already):
            # nothing is left to allocate, the derived transfers are bound.
            try:
                failure = self._resolve_locked(
                    work,
                    [],
                    None if primary is None else primary.device_indices,
                    None if primary is None else primary.host_indices,
                )
            except BaseException:
                self._free_pages(got.pages)
                raise
            if failure:
                self._free_pages(got.pages)
                return ResolveResult(False, [t.copy() for t in transfers], failure)
        filled = {t.name for t in work if t.device_indices is not None} if copy_in else ()
        self._scrub(got.pages, filled, owner)  # outside the lock (see _scrub), once the batch is bound
        return ResolveResult(True, work)

    def release_transfers(self, transfers: Sequence[PoolTransfer]) -> int:
        """Free the pages of every transfer this group allocated (``host_allocated``); pages freed.

        Derived transfers share another pool's pages and are skipped, so each allocation is freed
        exactly once. Everything is validated first (unknown pool: NotFound; a page freed twice,
        in this call or earlier: DoubleFree) and then nothing is freed.
        """
        with self._lock:
            plan: dict[str, list[PageArray]] = {}
            for t in transfers:
                if self._derived_source(t) is not None or not t.host_allocated or t.host_indices is None:
                    continue
                self.get_entry(t.name)
                plan.setdefault(t.name, []).append(as_page_array(t.host_indices, f"{t.name}.host_indices"))
            merged = {name: np.concatenate(arrays) for name, arrays in plan.items()}
            for name, pages in merged.items():
                self._entries[name].host_pool.allocator.check_free(pages)
            return sum(self._entries[name].host_pool.allocator.free(pages) for name, pages in merged.items())

    # ---- layers --------------------------------------------------------------

    def layer_routes(self, global_layer: int) -> list[LayerRoute]:
        """Every pool layer that holds global layer ``global_layer``, in pool-name order."""
        routes = ((e.name, e.pool_layer(global_layer)) for e in self.entries)
        return [LayerRoute(name, local) for name, local in routes if local is not None]

    def draft_routes(self, draft_layer: int) -> list[LayerRoute]:
        """Every pool layer that holds packed draft layer ``draft_layer``."""
        return [
            LayerRoute(e.name, e.draft_pool_layer(draft_layer), is_draft=True)
            for e in self.entries
            if draft_layer < e.packed_draft_layers
        ]

    def seal(self) -> None:
        """Allocate nothing more, ever (:meth:`PageAllocator.seal` of every pool)."""
        for entry in self.entries:
            entry.host_pool.allocator.seal()

    def close(self) -> None:
        """Close every pool (their segments' names survive for a warm restart)."""
        with self._lock:
            for entry in self._entries.values():
                entry.host_pool.close()
