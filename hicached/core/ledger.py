"""Which session owns each host page of one pool group.

Each group keeps one holder number per page of its allocating pools (:class:`PageOwners`, an
int32 per page, 0 for nobody); a session's :class:`PageLedger` is its holder number on that
table. Before, every session kept its own bool per page of every pool of its group: a group of
P pages with S sessions cost S x P bytes that ``host.budget`` did not count, and a byte-only
pool of 1-byte pages made each attach cost as much as the pool. Now a group's ownership costs
4 bytes per page whatever the number of sessions, and the budget counts it
(:mod:`hicached.core.footprint`).

Thread-safety: one lock per group guards the table and the holder numbers. A holder gives pages
away (frees or publishes them) with :meth:`PageLedger.take` *before* it lets go of them: the
test and the clear are one critical section, so of two concurrent calls giving away the same
pages exactly one gets them, and a page freed and handed back to this holder by a concurrent
allocation (:meth:`PageLedger.add`) is never forgotten by the call that freed it. The scans
over a whole pool (:meth:`PageLedger.count`, :meth:`PageLedger.take_all`) take the lock one
chunk at a time: only the holder's own calls change its entries, so a scan between its calls
sees them whole, and a scan never stalls other sessions' allocations for a whole pool.
Ownership: arrays handed in are only read; arrays returned are fresh copies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from hicached.errors import FailedPrecondition, InvalidArgument, clip

__all__ = ["OWNER_DTYPE", "PageLedger", "PageOwners"]

# One holder number per page; 0 is nobody. int32: holders are numbered among the live
# sessions of one group (numbers are reused), far below 2**31.
OWNER_DTYPE = np.int32

# Pages one step of a whole-pool scan covers: its temporaries (a bool per page, the pages
# found) stay this small however large the pool, and so does the lock's hold.
_SCAN_PAGES = 1 << 20


class PageOwners:
    """The owner table of one pool group: ``sizes`` maps each allocating pool to its pages."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self._lock = threading.Lock()
        self._owner = {name: np.zeros(n, dtype=OWNER_DTYPE) for name, n in sizes.items()}
        self._next = 1
        self._free: list[int] = []

    def ledger(self) -> PageLedger:
        """A new holder's ledger (owning nothing yet)."""
        with self._lock:
            if self._free:
                holder = self._free.pop()
            else:
                holder, self._next = self._next, self._next + 1
                if holder > np.iinfo(OWNER_DTYPE).max:
                    raise FailedPrecondition(
                        "a pool group has more page holders than its owner table numbers"
                    )
        return PageLedger(self, holder)

    def nbytes(self) -> int:
        """Bytes of the table (what :mod:`hicached.core.footprint` charges per page)."""
        return sum(a.nbytes for a in self._owner.values())

    def _table(self, pool: str) -> np.ndarray | None:
        return self._owner.get(pool)

    def _retire(self, holder: int) -> None:
        with self._lock:
            self._free.append(holder)


class PageLedger:
    """Which host pages of each allocating pool one holder (a session) owns: a view of its
    group's :class:`PageOwners`. Thread-safe (the group's lock); see the module docstring."""

    def __init__(self, owners: PageOwners, holder: int) -> None:
        self._owners = owners
        self._lock = owners._lock
        self._holder = holder
        self._closed = False

    def _table(self, pool: str) -> np.ndarray:
        table = self._owners._table(pool)
        if table is None:
            raise InvalidArgument(f"pool {clip(pool)} does not allocate pages: nobody owns its pages")
        return table

    def _open_locked(self) -> None:
        if self._closed:
            raise FailedPrecondition("this page ledger was closed (its session ended)")

    def of(self, owners: PageOwners) -> bool:
        """Whether this ledger is a holder of ``owners`` (and not of another group's table)."""
        return self._owners is owners

    def add(self, pool: str, pages: np.ndarray) -> None:
        """Own ``pages`` (just allocated to this holder)."""
        table = self._table(pool)
        with self._lock:
            self._open_locked()
            table[pages] = self._holder

    def owns(self, pool: str, pages: np.ndarray) -> np.ndarray:
        """One bool per page: owned by this holder (False for a pool that does not allocate)."""
        table = self._owners._table(pool)
        if table is None:
            return np.zeros(len(pages), dtype=bool)
        with self._lock:
            owned: np.ndarray = table[pages] == self._holder
        return owned

    def take(self, pages: Iterable[tuple[str, np.ndarray]]) -> tuple[str, int] | None:
        """Forget ``pages`` (pool, pages) if this holder owns every one: None then. Otherwise
        (a pool, its first page not owned) and nothing changes. Atomic; give a page away only
        once this returned None, and :meth:`give` back what then was not given away."""
        batch = list(pages)
        with self._lock:
            self._open_locked()
            for pool, arr in batch:
                table = self._owners._table(pool)
                if table is None:
                    if len(arr):
                        return pool, int(arr[0])
                    continue
                owned = table[arr] == self._holder
                if not owned.all():
                    return pool, int(arr[~owned][0])
            for pool, arr in batch:
                table = self._owners._table(pool)
                if table is not None:
                    table[arr] = 0
        return None

    def give(self, pages: Iterable[tuple[str, np.ndarray]]) -> None:
        """Own ``pages`` (pool, pages): those :meth:`take` forgot and the holder kept, or pages
        just filled for it. All or none: FailedPrecondition, and nothing owned, once closed."""
        batch = [(self._table(pool), arr) for pool, arr in pages]
        with self._lock:
            self._open_locked()
            for table, arr in batch:
                table[arr] = self._holder

    def take_all(self) -> dict[str, np.ndarray]:
        """Forget and return every page owned (per allocating pool, ascending) and close the
        ledger: the holder's last call (its session has ended). Idempotent: empty once closed."""
        out: dict[str, np.ndarray] = {}
        with self._lock:
            if self._closed:
                return out
            self._closed = True
        for name, table in self._owners._owner.items():
            found: list[np.ndarray] = []
            for at in range(0, len(table), _SCAN_PAGES):
                with self._lock:
                    chunk = table[at : at + _SCAN_PAGES]
                    mine = np.flatnonzero(chunk == self._holder)
                    chunk[mine] = 0
                found.append(mine + at)
            out[name] = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
        self._owners._retire(self._holder)  # nothing in the table names it any more
        return out

    def count(self) -> int:
        """Pages owned now (O(pages of the group), for GetStats)."""
        total = 0
        for table in self._owners._owner.values():
            for at in range(0, len(table), _SCAN_PAGES):
                with self._lock:
                    total += int(np.count_nonzero(table[at : at + _SCAN_PAGES] == self._holder))
        return total
