"""GroupState: one shared host pool group, its in-flight page counts and its content index.

Thread-safety: one lock guards the in-flight counts (``_busy``) and the frees they
defer (``_pending``): a page freed while a copy reads or writes it is freed when
the copy ends, so a free never races a copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hicached.core.journal import GroupJournal, JournalStore, PoolRecord
from hicached.core.ledger import PageOwners
from hicached.core.types import PoolRole, PoolState
from hicached.errors import (
    FailedPrecondition,
    HiCacheError,
    InvalidArgument,
    clip,
)
from hicached.index.index import ContentIndex
from hicached.index.tenant_keys import TenantL3Keys
from hicached.l2.allocator import ANYONE, distinct, first_repeat
from hicached.l2.group import HostPoolGroup, PoolTransfer
from hicached.l2.host_pool import HostKVPool

logger = logging.getLogger(__name__)


_FEW_PAGES = 16
_TINY = 4


def count(counts: np.ndarray, pages: np.ndarray, delta: int) -> None:
    """``counts[page] += delta`` for each of ``pages``, a page listed twice counted twice.

    Indexed assignment counts a repeated page once, so it serves distinct pages only;
    ``np.add.at`` counts repeats, at a flat ~2 us up to 16 pages, but took 61 us for 1,000
    where the check and the assignment take 8-27 (a copy's host pages are distinct but for
    odd requests, and most often ascending: :func:`first_repeat` checks that first).
    Up to _TINY pages are counted one at a time (~0.2 us each).
    """
    if len(pages) <= _TINY:
        for page in pages.tolist():
            counts[page] += delta
    elif len(pages) > _FEW_PAGES and first_repeat(pages) is None:
        counts[pages] += delta
    else:
        np.add.at(counts, pages, delta)


@dataclass
class GroupState:
    """One shared host pool group, its in-flight page counts and its content index."""

    group_id: str
    model_name: str
    group: HostPoolGroup
    nbytes: int
    index: ContentIndex | None = None  # set by the composition root (hicached.daemon.attach_content_index)
    # The registry's, shared by every group's index: one bound for all groups' remembered keys.
    tenant_keys: TenantL3Keys | None = None
    last_used: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _busy: dict[str, np.ndarray] = field(default_factory=dict)
    _pending: dict[str, np.ndarray] = field(default_factory=dict)
    # Who owns each page of the allocating pools: one table for all the group's sessions.
    owners: PageOwners = field(init=False)
    # The host bytes one page index stands for across the group's pools: what zeroing a
    # page an earlier owner wrote may cost (hicached.l2.group.HostPoolGroup._scrub).
    bytes_per_page: int = field(init=False)

    def __post_init__(self) -> None:
        self.bytes_per_page = sum(e.host_pool.page_bytes for e in self.group.entries)
        # Per page: host.budget charges these and the owner table (hicached/core/footprint.py).
        for entry in self.group.entries:
            total = entry.host_pool.total_pages
            self._busy[entry.name] = np.zeros(total, dtype=np.int32)
            self._pending[entry.name] = np.zeros(total, dtype=bool)
        self.owners = PageOwners(
            {e.name: e.host_pool.total_pages for e in self.group.entries if not e.indices_from_pool}
        )

    def pool(self, name: str) -> HostKVPool:
        return self.group.get_pool(name)

    def states(self) -> tuple[PoolState, ...]:
        out = []
        for e in self.group.entries:
            p = e.host_pool
            role = (
                PoolRole.ANCHOR
                if e.is_primary_index_anchor
                else PoolRole.DERIVED
                if e.indices_from_pool
                else PoolRole.SIDECAR
            )
            out.append(
                PoolState(
                    name=e.name,
                    role=role,
                    layout=p.layout,
                    page_size=p.page_size,
                    total_pages=p.num_pages,
                    free_pages=p.allocator.available(),
                    page_bytes=p.page_bytes,
                    segment=p.segment.name,
                )
            )
        return tuple(out)

    def owning_pools(self) -> list[str]:
        """Pools that allocate their own pages (not derived)."""
        return [e.name for e in self.group.entries if not e.indices_from_pool]

    # -- in-flight copies defer frees (a free racing a copy must not recycle its pages)

    def acquire(self, pages: Iterable[tuple[str, np.ndarray]]) -> None:
        with self._lock:
            for name, idx in pages:
                count(self._busy[name], idx, 1)

    def release(self, pages: Iterable[tuple[str, np.ndarray]]) -> int:
        """Drop in-flight marks; frees pages whose free was deferred. Returns pages freed."""
        freed = 0
        with self._lock:
            for name, idx in pages:
                busy = self._busy[name]
                count(busy, idx, -1)
                pending = self._pending[name]
                ready = idx[(busy[idx] == 0) & pending[idx]]
                if len(ready):
                    ready = distinct(ready)
                    pending[ready] = False
                    freed += self.pool(name).allocator.free(ready)
        return freed

    def free(self, name: str, pages: np.ndarray, *, by: int = ANYONE) -> int:
        """Free pages now, or when their in-flight copies finish. Validates first. ``by``:
        the owner whose bytes they hold (the allocator's tag; a deferred free is anyone's)."""
        if len(pages) == 0:
            return 0
        with self._lock:
            self._check_free_locked(name, pages)
            return self._free_locked(name, pages, by)

    def free_from_index(self, name: str, pages: np.ndarray) -> None:
        """Free pages the content index held (its own, allocated: no checks), when no copy
        reads or writes them any more: a session may have queued a copy of a page before it
        published it (the index's ``free_pages``, wired by ``daemon.attach_content_index``)."""
        with self._lock:
            self._free_locked(name, pages)

    def _check_free_locked(self, name: str, pages: np.ndarray) -> None:
        if first_repeat(pages) is not None:
            raise InvalidArgument(f"duplicate host pages in free of pool {clip(name)}")
        allocated = self.pool(name).allocator.is_allocated(pages)
        pending = self._pending[name][pages]
        bad = pages[~allocated | pending]
        if len(bad):
            raise FailedPrecondition(
                f"host page {int(bad[0])} of pool {clip(name)} is not allocated (double free?)"
            )

    def _free_locked(self, name: str, pages: np.ndarray, by: int = ANYONE) -> int:
        busy = self._busy[name][pages] > 0
        self._pending[name][pages[busy]] = True
        return self.pool(name).allocator.free(pages[~busy], by=by)

    def allocated_transfers(self, transfers: Iterable[PoolTransfer]) -> list[PoolTransfer]:
        """The transfers whose pages a release frees: marked ``host_allocated``, with pages,
        of a pool that allocates (a derived pool shares its source's pages: skipped by role)."""
        return [
            t
            for t in transfers
            if t.host_allocated
            and t.host_indices is not None
            and len(t.host_indices)
            and not self.group.get_entry(t.name).indices_from_pool
        ]

    def release_transfers(self, transfers: Iterable[PoolTransfer], *, by: int = ANYONE) -> int:
        """Free what a resolve allocated (exactly once; derived and given pages untouched);
        ``by`` as for :meth:`free`.

        Atomic: the whole batch is validated (unknown pool: NotFound; a page
        not allocated, listed twice or already being freed: FailedPrecondition
        or InvalidArgument) before any page is freed.
        """
        owned = self.allocated_transfers(transfers)
        with self._lock:
            merged: dict[str, list[np.ndarray]] = {}
            for t in owned:
                merged.setdefault(t.name, []).append(np.asarray(t.host_indices, dtype=np.int64))
            batch = {name: np.concatenate(arrays) for name, arrays in merged.items()}
            for name, pages in batch.items():
                self._check_free_locked(name, pages)
            return sum(self._free_locked(name, pages, by) for name, pages in batch.items())

    def journal(self) -> GroupJournal:
        """Freeze the content index and describe the group for a warm restart (see export_entries).
        The group allocates nothing from then on: the index's close frees the pages the journal
        lists, and a call still running at shutdown must not get one and write into it."""
        self.group.seal()
        entries = self.index.export_entries() if self.index is not None else []
        pools = tuple(
            PoolRecord(e.name, e.host_pool.num_pages, e.host_pool.segment.name, e.host_pool.incarnation)
            for e in self.group.entries
        )
        return GroupJournal(self.group_id, pools, tuple(entries))

    def save(self, journal: JournalStore) -> bool:
        """Write the group's warm-restart journal (a clean shutdown; sessions already
        ended). False, logged, when it cannot be written: the group is then dropped."""
        try:
            path = journal.write(self.journal())
        except (OSError, HiCacheError) as exc:
            logger.warning(
                "pool group %s: warm-restart journal not written (%s); dropping it", self.group_id, exc
            )
            return False
        logger.info("journaled pool group %s for a warm restart (%s)", self.group_id, path)
        return True

    def close(self, kept: bool = False) -> None:
        """Close the index (freeing its pages) and the pools. ``kept``: the group was
        saved for a warm restart, so its segments keep their names for the next daemon;
        otherwise they are unlinked."""
        if self.index is not None:
            self.index.close()
        pools = [e.host_pool for e in self.group.entries]
        self.group.close()
        if not kept:
            for pool in pools:
                pool.unlink()
