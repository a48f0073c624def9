"""The content index's entries: content key -> :class:`Entry`, LRU ordered, and the pages it owns.

:class:`EntryTable` is the index's state and its one lock; the index's
other rooms (:mod:`.backup`, :mod:`.writer`, :mod:`.prefetch`) change
entries only through its methods. Each method is one critical section:
it takes the table's lock, never holds it while calling anything but the
backup queue's reservations handed to :meth:`EntryTable.claim` and
:meth:`EntryTable.evict` and the daemon's :class:`~hicached.index.tenant_keys.TenantL3Keys`
(which only take their own locks), and never does I/O.

Holds: an entry's pages are freed exactly once, when it has left the
table (``detached``) and its last hold is dropped (``refs``: pins plus
in-flight backups or evictions), or at :meth:`EntryTable.close`. Eviction is
LRU over unreferenced entries; keys of one prefix are touched deepest-first,
so a prefix is shortened from its tail.

Clears: :meth:`EntryTable.detach` reaches the entries an eviction still holds
for their L3 write (so the write's copy is deleted, not kept), and moves the
clear epoch (so an L3 read that began before it publishes nothing); until
:meth:`EntryTable.end_clear` (L3 deleted) no L3 read publishes anything. A tenant's
clear moves its tenant's epoch only (one of :data:`EPOCH_BUCKETS`, by a keyed hash of the
name, so a tenant cannot choose to share another's), and one that finds nothing moves none:
a worker clearing its own tenant in a loop cannot stop other tenants' L3 reads from publishing.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from hicached.errors import FailedPrecondition, Unavailable, clip
from hicached.index.entries import SELECTIVE_HITS, Entry, EntryRecord
from hicached.index.pools import GroupView
from hicached.index.tenant_keys import TenantL3Keys
from hicached.index.types import Pin
from hicached.l2.allocator import PageArray

__all__ = ["EntryTable"]

# Process-wide, so a pin handed to the wrong index is refused rather than
# releasing someone else's pages.
_PIN_IDS = itertools.count(1)

# Tenants' clear epochs share this many counters (a clear of one moves the counter of every
# tenant hashed with it: its reads then publish nothing, a safe miss); one more is the group's.
EPOCH_BUCKETS = 64
_GROUP = EPOCH_BUCKETS
Epoch = tuple[int, ...]  # a clear_epoch(): every counter, the group's last


class EntryTable:
    """Entries of one content index and the pages they own. Thread-safe (one lock).

    ``tenant_keys``: where the keys of each tenant (the default one included) written to L3 are remembered (for
    ``clear(tenant)``): the daemon's, shared by every group's table so that one bound holds
    for all of them; a table of its own when not given. This table's keys there are
    forgotten at :meth:`close`."""

    def __init__(self, view: GroupView, tenant_keys: TenantL3Keys | None = None) -> None:
        self._view = view
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        # Per page, as each entry is per key: host.budget charges both (hicached/core/footprint.py).
        self._owned = [np.zeros(a.capacity, dtype=bool) for a in view.allocators]
        self._pins: dict[int, tuple[Entry, ...]] = {}
        self._pinned_entries = 0
        self._tenant_keys = tenant_keys if tenant_keys is not None else TenantL3Keys()
        self._owner = self._tenant_keys.new_owner()
        self._held: dict[int, Entry] = {}  # evicted, held until their L3 write ends (by id)
        # The clear epochs, one per tenant bucket and the group's last: detach() and end_clear()
        # move them; _clearing counts clears between the two (their L3 delete is to come).
        self._clears = [0] * (EPOCH_BUCKETS + 1)
        self._clearing = [0] * (EPOCH_BUCKETS + 1)
        self._salt = os.urandom(16)  # the buckets' hash key: no client can aim at a bucket
        self.closed = False  # written under the lock; a stale read only delays a refusal
        self._frozen = False  # freeze() took the final snapshot: no more changes
        self._counts = collections.Counter[str]()

    # ------------------------------------------------------------- queries

    def _run_locked(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if key not in self._entries:
                return i
        return len(keys)

    def l2_run(self, keys: Sequence[str]) -> int:
        """Leading run of ``keys`` held in L2."""
        with self._lock:
            return self._run_locked(keys)

    def resident(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key: held here (in L2)."""
        with self._lock:
            return [key in self._entries for key in keys]

    def not_in_l3(self, keys: Sequence[str]) -> list[Entry]:
        """The cached entries among ``keys`` that L3 lacks."""
        with self._lock:
            return [e for k in keys if (e := self._entries.get(k)) is not None and not e.in_l3]

    def dirty(self) -> list[Entry]:
        """Entries neither in L3 nor queued for it (LRU first)."""
        with self._lock:
            return [e for e in self._entries.values() if not (e.in_l3 or e.backup_queued)]

    def sizes(self, tenant: str | None = None) -> tuple[int, int, int, dict[str, int]]:
        """(entries, pinned entries, entries also in L3, totals: published, prefetched, evicted, restored).
        With a ``tenant``, entries counts only that tenant's."""
        with self._lock:
            in_l3 = sum(e.in_l3 for e in self._entries.values())
            entries = len(self._entries)
            if tenant is not None:
                entries = sum(e.tenant == tenant for e in self._entries.values())
            return entries, self._pinned_entries, in_l3, dict(self._counts)

    def owned_pages(self) -> dict[str, PageArray]:
        with self._lock:
            return {
                name: np.flatnonzero(owned).astype(np.int64)
                for name, owned in zip(self._view.alloc_names, self._owned, strict=True)
            }

    # ------------------------------------------------------------- insert / pin

    def clear_epoch(self) -> Epoch:
        """The clear epochs now: take them before reading what :meth:`insert` will publish or
        writing what :meth:`mark_stored` will record."""
        with self._lock:
            return tuple(self._clears)

    def _bucket(self, tenant: str) -> int:
        digest = hashlib.blake2b(tenant.encode("utf-8"), digest_size=8, key=self._salt).digest()
        return int.from_bytes(digest, "little") % EPOCH_BUCKETS

    def _unsure_locked(self, epoch: Epoch, tenant: str) -> bool:
        """A clear of the group or of ``tenant``'s bucket ran since ``epoch`` or is running."""
        b = self._bucket(tenant)
        return (
            epoch[_GROUP] != self._clears[_GROUP]
            or epoch[b] != self._clears[b]
            or self._clearing[_GROUP] > 0
            or self._clearing[b] > 0
        )

    def insert(
        self,
        keys: Sequence[str],
        columns: Sequence[PageArray],
        tenant: str,
        *,
        in_l3: bool,
        strict: bool,
        epoch: Epoch | None = None,
    ) -> tuple[npt.NDArray[np.bool_], list[Entry], list[Entry]]:
        """Add entries for new keys, touch existing ones; (mask of keys taken, new entries, entries now hot).

        ``columns`` holds one page array per independent pool, one page per key.
        ``strict``: FailedPrecondition, changing nothing, when a page is already the table's.
        ``epoch``: the :meth:`clear_epoch` taken before the pages were read; when a clear
        ran since or is running (its L3 delete to come), nothing is taken (the pages may
        hold what the clear removed) and the mask is empty.
        """
        rows = list(zip(*(c.tolist() for c in columns), strict=True)) if len(keys) else []
        mask = np.zeros(len(keys), dtype=bool)
        new: list[Entry] = []
        hot: list[Entry] = []
        with self._lock:
            if self.closed or self._frozen:
                raise Unavailable("the content index is closed")
            if epoch is not None and self._unsure_locked(epoch, tenant):
                return np.zeros(0, dtype=bool), new, hot  # taken: none (not even touched)
            if strict:
                for col, (owned, column) in enumerate(zip(self._owned, columns, strict=True)):
                    taken = np.flatnonzero(owned[column])
                    if taken.size:
                        i = int(taken[0])
                        raise FailedPrecondition(
                            f"page {int(column[i])} of pool {self._view.alloc_names[col]!r} already "
                            f"belongs to the content index (key {clip(keys[i])} cannot take it)"
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
            self._counts["prefetched" if in_l3 else "published"] += len(new)
        new.reverse()
        hot.reverse()
        return mask, new, hot

    def pin(self, keys: Sequence[str]) -> tuple[Pin, list[Entry]]:
        """Hold the leading L2 run of ``keys``; (the pin, entries now hot). Counts a hit on each."""
        with self._lock:
            if self.closed:
                raise Unavailable("the content index is closed")
            run = [self._entries[k] for k in keys[: self._run_locked(keys)]]
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
        return Pin(pin_id, tuple(e.key for e in run), pages), hot

    def unpin(self, pin: Pin) -> None:
        with self._lock:
            if self.closed:
                return
            entries = self._pins.get(pin.id)
            if entries is None or tuple(e.key for e in entries) != pin.keys:
                raise FailedPrecondition(f"pin {pin.id} is not held by this index (released twice?)")
            del self._pins[pin.id]
            self._drop_refs_locked(entries, pinned=True)

    # ------------------------------------------------------------- holds

    def _drop_refs_locked(self, entries: Iterable[Entry], *, pinned: bool) -> None:
        doomed = []
        for entry in entries:
            entry.refs -= 1
            if pinned:
                entry.pins -= 1
                if entry.pins == 0:
                    self._pinned_entries -= 1
            if entry.refs == 0 and entry.detached and not entry.freed:  # close() may have freed it
                doomed.append(entry)
        self._free_locked(doomed)

    def _free_locked(self, entries: Sequence[Entry]) -> None:
        """Return entries' pages to their allocators (exactly once) and forget them."""
        if not entries:
            return
        for entry in entries:
            assert not entry.freed, f"entry {entry.key!r} freed twice"
            entry.freed = True
            self._held.pop(id(entry), None)
        for col, owned in enumerate(self._owned):
            pages = np.fromiter((e.pages[col] for e in entries), dtype=np.int64, count=len(entries))
            owned[pages] = False
            self._view.free(col, pages)

    def release(self, entries: Sequence[Entry]) -> None:
        """Drop the holds :meth:`evict` left on ``entries`` (freeing the detached ones)."""
        with self._lock:
            self._drop_refs_locked(entries, pinned=False)

    def claim(self, entries: Sequence[Entry], admit: Callable[[int], int]) -> tuple[list[Entry], int]:
        """Hold the entries that still need a backup, as many as ``admit(n)`` lets through;
        (held and marked queued, refused). ``admit`` runs under the table's lock; if it
        raises, nothing changes."""
        with self._lock:
            todo = [e for e in entries if not (e.detached or e.in_l3 or e.backup_queued)]
            taken = todo[: admit(len(todo))]
            for entry in taken:
                entry.refs += 1
                entry.backup_queued = True
            return taken, len(todo) - len(taken)

    def unclaim(self, entries: Sequence[Entry]) -> None:
        """A backup is done with ``entries`` (stored or not): unmark and drop its holds
        (after :meth:`close` too: an evicted entry held for its write is freed here)."""
        with self._lock:
            for entry in entries:
                entry.backup_queued = False
            self._drop_refs_locked(entries, pinned=False)

    def mark_stored(
        self, entries: Sequence[Entry], ok: Sequence[bool], epoch: Epoch
    ) -> tuple[list[str], set[str]]:
        """Record the entries L3 now holds; the keys cleared meanwhile (their L3 copies must go)
        and their tenants (for :meth:`end_clear`).

        ``epoch``: the :meth:`clear_epoch` taken before the write. When a clear ran since or is
        running, its L3 delete may have removed (or may yet remove) what was written: the
        entries are not counted as in L3 then (a later backup or write-back writes them again).

        A cleared key published again since is no orphan: its L3 object is the new entry's
        too (written, or to be written, under the same name), so it is not deleted.

        When there are orphans, their L3 delete counts as a clear's from now until
        :meth:`end_clear` (the caller's, after the delete): a key published again meanwhile
        and written to L3 may lose that copy to the delete, so no write finishing in that
        window counts as in L3, and no L3 read publishes."""
        orphans: list[str] = []
        tenants: set[str] = set()
        unsure: dict[str, bool] = {}  # per tenant of the batch (one hash each, not one per entry)
        with self._lock:
            for entry, good in zip(entries, ok, strict=True):
                if not good:
                    continue
                if entry.cleared:  # clear() ran while we wrote: it must not come back
                    if entry.key not in self._entries:
                        orphans.append(entry.key)
                        tenants.add(entry.tenant)
                    continue
                if entry.tenant not in unsure:
                    unsure[entry.tenant] = self._unsure_locked(epoch, entry.tenant)
                if unsure[entry.tenant]:
                    continue
                entry.in_l3 = True
                # Every tenant's, the default one's ("") too: its worker clears only its own.
                if not self.closed:  # close() forgot this table's keys for good
                    self._tenant_keys.remember(self._owner, entry.key, entry.tenant)
            for b in {self._bucket(t) for t in tenants}:
                self._clears[b] += 1
                self._clearing[b] += 1
        return orphans, tenants

    # ------------------------------------------------------------- eviction

    def evictable(self, wanted: int, *, in_l3_only: bool = False) -> int:
        """Unreferenced entries from the LRU end (only those L3 holds with ``in_l3_only``),
        counted up to ``wanted`` (0 once closed or frozen)."""
        with self._lock:
            if self.closed or self._frozen:
                return 0
            able = 0
            for entry in self._entries.values():
                if able >= wanted:
                    break
                if entry.refs == 0 and (entry.in_l3 or not in_l3_only):
                    able += 1
            return able

    def evict(
        self,
        wanted: int,
        *,
        hold_dirty: bool,
        in_l3_only: bool = False,
        queue_dirty: Callable[[int], None] | None = None,
    ) -> tuple[int, list[Entry]]:
        """Detach up to ``wanted`` least recently used unreferenced entries (only those L3
        holds with ``in_l3_only``); (evicted, dirty ones held).

        The pages of evicted entries already in L3 are freed now. With
        ``hold_dirty`` the others stay held for the caller to write and then
        :meth:`release`; without, they are freed too. ``queue_dirty(n)`` (the
        backup queue's reservation, called under the table's lock, also with 0)
        queues the held ones at once: they are marked queued for a backup that
        :meth:`unclaim` ends, so a flush waits for them.
        """
        with self._lock:
            if self.closed or self._frozen:
                if queue_dirty is not None:
                    queue_dirty(0)
                return 0, []
            victims: list[Entry] = []
            for entry in self._entries.values():
                if len(victims) >= wanted:
                    break
                if entry.refs == 0 and (entry.in_l3 or not in_l3_only):
                    victims.append(entry)
            for entry in victims:
                del self._entries[entry.key]
                entry.detached = True
                entry.refs += 1
            dirty = [e for e in victims if not e.in_l3] if hold_dirty else []
            for entry in dirty:  # a clear meanwhile must reach them (detach)
                self._held[id(entry)] = entry
            self._counts["evicted"] += len(victims)
            self._drop_refs_locked([e for e in victims if not (hold_dirty and not e.in_l3)], pinned=False)
            # Reserved last: whatever raised before left the caller's eviction slot unreserved,
            # for it to give back (Writer.evict_ahead), not reserved for writes nobody runs.
            if queue_dirty is not None:  # (a victim had no hold, so no backup was queued for it)
                for entry in dirty:
                    entry.backup_queued = True
                queue_dirty(len(dirty))
            return len(victims), dirty

    def detach(self, tenant: str | None) -> tuple[int, set[str] | None, bool]:
        """clear(): every entry (or one tenant's) leaves now; pinned ones are freed at their last
        unpin. (Entries dropped, the tenant's keys known to be in L3 (None without a tenant),
        whether a clear began: call :meth:`end_clear` after the L3 delete then.) A tenant with
        no entry, none held for a write and no key known in L3 has nothing to clear: no epoch
        moves. The keys stay remembered until :meth:`forget_l3`."""
        with self._lock:
            if self._frozen:  # journaled: the next daemon would bring the entries back
                raise Unavailable(
                    "the content index is closing and its entries are journaled for a warm restart: "
                    "clear on the daemon that replaces this one"
                )
            targets = [e for e in self._entries.values() if tenant is None or e.tenant == tenant]
            held = [e for e in self._held.values() if tenant is None or e.tenant == tenant]
            l3_keys = None if tenant is None else self._tenant_keys.of(self._owner, tenant)
            if tenant is not None and not (targets or held or l3_keys):
                return 0, l3_keys, False
            slot = _GROUP if tenant is None else self._bucket(tenant)
            self._clears[slot] += 1
            self._clearing[slot] += 1
            for entry in targets:
                del self._entries[entry.key]
                entry.detached = entry.cleared = True
            for entry in held:  # evicted, their L3 write still to come or running
                entry.cleared = True
            self._free_locked([e for e in targets if e.refs == 0])
            if l3_keys is not None:
                l3_keys.update(e.key for e in targets if e.in_l3)
            return len(targets), l3_keys, True

    def end_clear(self, tenants: Iterable[str | None]) -> None:
        """The L3 delete of a :meth:`detach` of each of ``tenants`` (None: the group's), or of
        :meth:`mark_stored`'s orphans of them, is over (done or failed): their L3 reads publish
        again, but not one whose epoch was taken before (it may have read what the delete
        removed)."""
        with self._lock:
            for slot in {_GROUP if t is None else self._bucket(t) for t in tenants}:
                self._clearing[slot] -= 1
                self._clears[slot] += 1

    def forget_l3(self, keys: Iterable[str] | None) -> None:
        """The L3 copies of ``keys`` (None: of every tenant) are deleted: stop remembering them.
        Called after the delete succeeded, so a failed one can be retried by a later clear."""
        with self._lock:
            self._tenant_keys.forget(self._owner, keys)

    # ------------------------------------------------------------- warm restart / close

    def freeze(self) -> list[EntryRecord]:
        """Take the final snapshot (LRU first); from now on nothing is added or evicted."""
        with self._lock:
            if self.closed:
                raise Unavailable("the content index is closed")
            self._frozen = True
            names = self._view.alloc_names
            return [
                EntryRecord(e.key, dict(zip(names, e.pages, strict=True)), e.tenant, e.in_l3)
                for e in self._entries.values()
            ]

    def check_empty(self) -> None:
        with self._lock:
            if self.closed or self._frozen:
                raise Unavailable("the content index is closed")
            if self._entries:
                raise FailedPrecondition(
                    f"restore needs an empty index; it holds {len(self._entries)} entries"
                )

    def install(self, records: Sequence[EntryRecord], columns: Sequence[PageArray]) -> list[Entry]:
        """Entries for ``records`` (LRU first) over pages the caller marked allocated."""
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
        return restored

    def close(self) -> None:
        """Free every page the table owns, pinned or not, exactly once; outstanding pins become no-ops."""
        with self._lock:
            self.closed = True
            # The daemon's store outlives this table: its keys there would only take room.
            self._tenant_keys.forget(self._owner, None)
            alive = list(self._entries.values())
            self._entries.clear()
            for entries in self._pins.values():
                alive.extend(e for e in entries if e.detached and not e.freed)
            self._pins.clear()
            self._free_locked(list({id(e): e for e in alive if not e.freed}.values()))
