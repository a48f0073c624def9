"""The file backend's key -> slot index: LRU order, byte accounting and eviction.

The index lives in memory and is rebuilt at start by reading the slot headers
(headers verified; payloads verified on read; duplicates of one key resolved by
the higher sequence number), about 8 us per page from the page cache. Headers in
a hole of a sparse slab file are not read: they are free slots
(:mod:`~hicached.l3.file.extents`). LRU order is restored from write order. The
sequence counter goes on from the highest number found; where that is past
:data:`RENUMBER_ABOVE` (a header this store did not write) the pages are
renumbered on disk first (:meth:`PageIndex.renumber`).

``capacity`` bounds the bytes of occupied slots; a page that needs room evicts
least-recently-used pages that no reader pins. ``max_pages`` bounds the entries
(each holds its key in memory: 350-750 bytes a page, measured; a stranger's pages
of a few bytes would otherwise grow the daemon by capacity / 1 KiB entries); the
page that goes over it evicts the least recently used one. A freed slot is reused by later
pages of its size. Deleted, evicted and corrupt pages get their slot header
zeroed so they do not come back at the next start.

Not thread-safe: the backend calls every method with its lock held (the only
I/O here is the start-up scan, the 4-byte header clears and, while the capacity is
lowered after a full disk, a ``statvfs`` at most once a second).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from hicached.l3.base import BackendStats
from hicached.l3.file.extents import header_slots
from hicached.l3.file.layout import (
    HEADER_BYTES,
    SLAB_NAME,
    SLOT_ALIGN,
    TOMBSTONE,
    pack_header,
    parse_header,
    slot_bytes_for,
)
from hicached.l3.file.slabs import Entry, Slab

__all__ = ["RENUMBER_ABOVE", "PageIndex"]

log = logging.getLogger(__name__)

# Seconds between looks at the filesystem's room while the capacity is lowered (a statvfs).
REGROW_INTERVAL_S = 1.0
# LRU pages one page may evict to keep the slab files within the capacity. Evicting a page in
# the middle of a file frees a slot of its size but no disk, so after a switch to a new page
# size the old size's pages go (oldest first) until the ones at the file's end do; a bound
# keeps one write from holding the lock for a whole file (~10 us a victim): the page is then
# refused and the next writes go on where it stopped.
RECLAIM_VICTIMS = 1024
# The highest sequence number the start-up scan takes as it is. Numbers grow by one per page
# written, so a store reaches it after 2**62 writes (14,000 years at 10 million a second); a header
# above it was written by something else (planted by whoever can write the directory, or another
# program's), and the counter following it would soon pass MAX_SEQ: the pages written next would
# be refused at the next start. Such a store is renumbered at start, leaving 2**62 numbers of room.
RENUMBER_ABOVE = 1 << 62


class PageIndex:
    """Entries of the stored pages, their slabs and the counters (guarded by the backend lock)."""

    def __init__(
        self, root: Path, capacity: int, *, max_pages: int = 1 << 20, direct_io: bool = False
    ) -> None:
        self.root = root
        self.max_pages = max_pages
        self.direct_io = direct_io
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # LRU order: oldest first
        self.slabs: dict[int, Slab] = {}
        self.used = 0  # bytes of occupied or reserved slots
        self.payload = 0
        self.seq = 0
        # The configured capacity, lowered when the disk fills up first (ENOSPC): from then
        # on LRU eviction makes room instead of every write failing. Raised back towards the
        # configured one once the filesystem has room again (another file deleted meanwhile).
        self.capacity = self.configured = capacity
        self._regrow_at = 0.0  # monotonic time of the next look at the filesystem's room
        self.hits = self.misses = self.corrupt = self.evicted = 0
        self.closed = False  # files closed: freeing a slot no longer touches them

    def slab(self, slot_bytes: int) -> Slab:
        slab = self.slabs.get(slot_bytes)
        if slab is None:
            slab = Slab(self.root / f"slab-{slot_bytes}.dat", slot_bytes, direct_io=self.direct_io)
            self.slabs[slot_bytes] = slab
        return slab

    def close_files(self) -> None:
        self.closed = True
        for slab in self.slabs.values():
            slab.close()
        self.slabs.clear()

    # ------------------------------------------------------------------ start

    def rebuild(self) -> None:
        """Read the slot headers of the slab files under ``root`` into the index (those in a
        hole are never-written slots: free, not read; every one where the filesystem cannot
        list its holes)."""
        found: dict[str, Entry] = {}
        corrupt: list[tuple[Slab, int]] = []
        stale: list[Entry] = []  # older copies of a key found: their slots are free
        for path in sorted(self.root.iterdir()):
            match = SLAB_NAME.match(path.name)
            if match is None:
                continue
            size = int(match.group(1))
            if size < HEADER_BYTES or size % SLOT_ALIGN or path.is_symlink() or not path.is_file():
                log.warning(
                    "file backend %s: ignored %s (not a slab file this backend writes)", self.root, path.name
                )
                continue
            slab = self.slab(size)
            file_bytes = os.fstat(slab.fd).st_size
            nslots = -(-file_bytes // slab.slot_bytes)
            used: set[int] = set()
            # Only slots whose header meets data: a header in a hole is a free slot's.
            for slot in header_slots(slab.fd, slab.slot_bytes, file_bytes, slab.path):
                # One read per header: reading 1 MiB of adjacent slots at a time measured 10-14%
                # faster for slots under ~8 KiB, 55% slower for 64 KiB pages (warm page cache).
                header = os.pread(slab.fd, HEADER_BYTES, slab.offset(slot))
                parsed = parse_header(header)
                torn = parsed is not None and slab.offset(slot) + HEADER_BYTES + parsed[2] > file_bytes
                if parsed is None or torn or slot_bytes_for(parsed[2]) != slab.slot_bytes:
                    # A never-written or cleared slot starts with a zero magic; anything else
                    # that does not verify, or whose payload the file does not hold (a write
                    # cut short by a full disk), is a damaged page, dropped and counted.
                    if header[: len(TOMBSTONE)].strip(b"\0"):
                        corrupt.append((slab, slot))
                    continue
                key, seq, length, checksum = parsed
                entry = Entry(key, slab, slot, length, checksum, seq, read_back=False)
                old = found.get(key)
                if old is not None and old.seq > seq:
                    stale.append(entry)
                    continue
                if old is not None:
                    stale.append(old)
                if old is not None and old.slab is slab:
                    used.discard(old.slot)
                elif old is not None:
                    old.slab.release(old.slot)
                found[key] = entry
                used.add(slot)
            slab.restore(nslots, used)
        ordered = sorted(found.values(), key=lambda e: e.seq)
        if ordered and ordered[-1].seq > RENUMBER_ABOVE:
            ordered = self.renumber(ordered, stale)
        for entry in ordered:
            self.entries[entry.key] = entry
            self.used += entry.slab.slot_bytes
            self.payload += entry.length
            self.seq = max(self.seq, entry.seq)
        if corrupt:
            self.corrupt += len(corrupt)
            log.warning(
                "file backend %s: dropped %d page(s) whose slot header failed verification",
                self.root,
                len(corrupt),
            )
            for slab, slot in corrupt:  # cleared: counted once, not again at every start
                self.tombstone(Entry("", slab, slot, 0, 0, 0))
        self.evict_for(0)  # a smaller capacity than last time: trim the oldest
        self._evict_over_count()
        if self.entries:
            log.info("file backend %s: rebuilt index of %d pages", self.root, len(self.entries))

    def renumber(self, ordered: list[Entry], stale: list[Entry]) -> list[Entry]:
        """Rewrite the headers of the pages found (``ordered``: oldest first) with the numbers
        1, 2, ... in the same order; the entries with their new numbers.

        Why renumber rather than drop the header past :data:`RENUMBER_ABOVE`: whatever bound the
        scan takes, a header just under it moves the counter past it, and the pages written next
        would be dropped at the next start. Ranks keep the write order and the LRU order, and leave
        the counter as low as the number of pages. The older copies of a key (``stale``) are
        cleared and synced first, or one would outnumber its newer copy's new number; the new
        numbers are synced before any page is written after them. Runs only on a store that holds
        a header it did not write (never for an honest one); an I/O error stops the start, as one
        in the scan does, rather than leave numbers that could order copies wrongly.
        """
        log.warning(
            "file backend %s: a slot header carries sequence number %d, past the %d this store "
            "could have reached (not written by this backend); renumbering %d page(s)",
            self.root,
            ordered[-1].seq,
            RENUMBER_ABOVE,
            len(ordered),
        )
        for entry in stale:
            os.pwrite(entry.slab.fd, TOMBSTONE, entry.slab.offset(entry.slot))
        self._sync_slabs()
        renumbered: list[Entry] = []
        for seq, entry in enumerate(ordered, start=1):
            header = pack_header(entry.key.encode("utf-8"), seq, entry.length, entry.checksum)
            os.pwrite(entry.slab.fd, header, entry.slab.offset(entry.slot))
            renumbered.append(
                Entry(
                    entry.key,
                    entry.slab,
                    entry.slot,
                    entry.length,
                    entry.checksum,
                    seq,
                    read_back=entry.read_back,
                )
            )
        self._sync_slabs()
        return renumbered

    def _sync_slabs(self) -> None:
        for slab in self.slabs.values():
            os.fdatasync(slab.fd)

    # -------------------------------------------------------- slots and eviction

    def tombstone(self, entry: Entry) -> None:
        try:
            os.pwrite(entry.slab.fd, TOMBSTONE, entry.slab.offset(entry.slot))
        except OSError as exc:  # the slot is still freed; its stale header only costs a miss
            log.warning("file backend %s: could not clear slot header: %s", self.root, exc)

    def drop(self, entry: Entry, *, tombstone: bool) -> None:
        """Remove an indexed entry; its slot is freed once unpinned."""
        del self.entries[entry.key]
        self.payload -= entry.length
        entry.dead = True
        entry.tomb = tombstone
        self.maybe_free(entry)

    def maybe_free(self, entry: Entry) -> None:
        if not entry.dead or entry.pins or entry.freed:
            return
        entry.freed = True
        self.used -= entry.slab.slot_bytes
        if self.closed:  # files are gone; the next start rebuilds the allocator
            return
        if entry.tomb:
            self.tombstone(entry)
        entry.slab.release(entry.slot)

    def evict_for(self, need: int) -> bool:
        """Evict LRU unpinned pages until ``need`` more bytes fit; False (nothing evicted)
        when they cannot."""
        if self.used + need <= self.capacity:
            return True
        if self.capacity < self.configured and self.regrow() and self.used + need <= self.capacity:
            return True
        victims: list[Entry] = []
        freed = 0
        excess = self.used + need - self.capacity
        for entry in self.entries.values():
            if freed >= excess:
                break
            if entry.pins == 0:
                victims.append(entry)
                freed += entry.slab.slot_bytes
        if freed < excess:
            return False
        for entry in victims:
            # Cleared so an evicted page does not come back at the next start
            # when its slot is not reused before then.
            self.drop(entry, tombstone=True)
        self.evicted += len(victims)
        return True

    def _evict_over_count(self) -> None:
        """Evict LRU unpinned pages while more than ``max_pages`` are indexed (pinned ones stay:
        at most the pages of the reads under way go over)."""
        excess = len(self.entries) - self.max_pages
        if excess <= 0:
            return
        victims: list[Entry] = []
        for entry in self.entries.values():  # a read pins and moves its pages to the end
            if len(victims) == excess:
                break
            if entry.pins == 0:
                victims.append(entry)
        for entry in victims:
            self.drop(entry, tombstone=True)
        self.evicted += len(victims)

    def evict_same_slab(self, slab: Slab) -> bool:
        """Evict the least recently used unpinned page of ``slab``: on a full disk only a slot
        of the same size has blocks a new page can use. False when there is none."""
        for victim in self.entries.values():
            if victim.slab is slab and victim.pins == 0:
                self.drop(victim, tombstone=True)
                self.evicted += 1
                return True
        return False

    def reserve(self, key: str, length: int) -> Entry | None:
        """A fresh entry in a newly allocated slot for ``key`` (evicting for room), not yet
        indexed (its checksum is set by the write); None when the page cannot fit."""
        size = slot_bytes_for(length)
        if size > self.configured:
            return None  # else evict_for finds room, or raises a lowered capacity back
        try:
            slab = self.slab(size)
        except OSError as exc:  # e.g. something else holds the slab's name: this size is not stored
            log.warning("file backend %s: cannot open slab-%d.dat: %s", self.root, size, exc)
            return None
        if not self.evict_for(size) or not self._disk_room(slab):
            return None
        self.seq += 1
        self.used += size
        return Entry(key, slab, slab.alloc(), length, 0, self.seq)

    def disk_bytes(self) -> int:
        """Bytes the slab files may hold on disk together (slots handed out, free ones included)."""
        return sum(slab.file_bytes for slab in self.slabs.values())

    def _disk_room(self, slab: Slab) -> bool:
        """Whether ``slab`` can hand out a slot with all slab files within the capacity.

        Why: ``used`` counts occupied slots only, and a file never shrank, so a client that
        wrote pages of one new size after another (its pool shape is its choice) grew the
        directory by up to the capacity per size. A free slot of its own costs no new disk;
        otherwise the free slots at the ends of the files are truncated, and LRU pages of any
        size are evicted (at most :data:`RECLAIM_VICTIMS` for this page; a later page goes on)
        until the file may grow. False when it may not.
        """
        if slab.has_free() or self.disk_bytes() + slab.slot_bytes <= self.capacity:
            return True
        if self.capacity < self.configured and self.regrow():
            return self._disk_room(slab)
        for other in self.slabs.values():
            other.trim()
        for _ in range(RECLAIM_VICTIMS):
            if slab.has_free() or self.disk_bytes() + slab.slot_bytes <= self.capacity:
                return True
            victim = next((e for e in self.entries.values() if e.pins == 0), None)
            if victim is None:
                return False
            self.drop(victim, tombstone=True)
            self.evicted += 1
            victim.slab.trim()
        return slab.has_free() or self.disk_bytes() + slab.slot_bytes <= self.capacity

    def reserve_on_disk(self, failed: Entry) -> Entry | None:
        """After a full disk: a new slot with existing disk blocks for ``failed``'s page."""
        size = failed.slab.slot_bytes
        if not self.evict_for(size):
            return None
        slot = failed.slab.alloc_on_disk()
        while slot is None and self.evict_same_slab(failed.slab):
            slot = failed.slab.alloc_on_disk()
        if slot is None:
            return None
        self.seq += 1
        self.used += size
        return Entry(failed.key, failed.slab, slot, failed.length, failed.checksum, self.seq)

    def lower_capacity_to_disk(self) -> None:
        """The disk filled before the capacity did: what it holds for us is what the slab files
        already occupy (free slots included: their blocks exist)."""
        on_disk = sum(os.fstat(slab.fd).st_size for slab in self.slabs.values())
        lowered = max(on_disk, SLOT_ALIGN)
        if lowered < self.capacity:
            log.warning(
                "file backend %s: the disk is full at %d bytes of slab files; capacity lowered "
                "from %d to %d bytes (LRU eviction makes room from now on)",
                self.root,
                on_disk,
                self.capacity,
                lowered,
            )
            self.capacity = lowered

    def regrow(self) -> bool:
        """After :meth:`lower_capacity_to_disk`: raise the capacity back towards the configured
        one by nine tenths of the room the filesystem has now (a later ENOSPC lowers it again),
        looking at most once a second; whether it rose."""
        now = time.monotonic()
        if now < self._regrow_at:
            return False
        self._regrow_at = now + REGROW_INTERVAL_S
        try:
            fs = os.statvfs(self.root)
        except OSError:
            return False
        on_disk = sum(os.fstat(slab.fd).st_size for slab in self.slabs.values())
        raised = min(self.configured, on_disk + fs.f_bavail * fs.f_frsize * 9 // 10)
        if raised <= self.capacity:
            return False
        log.warning(
            "file backend %s: the disk has room again; capacity raised from %d to %d bytes (configured: %d)",
            self.root,
            self.capacity,
            raised,
            self.configured,
        )
        self.capacity = raised
        return True

    def commit(self, entry: Entry, written: bool) -> bool:
        """Index a fresh entry whose write ended; whether it is now indexed. One that lost a race
        with another writer of its key (that copy stands), or whose write failed (its torn
        header is cleared), is freed."""
        if written and entry.key not in self.entries:
            self.entries[entry.key] = entry
            self.payload += entry.length
            self._evict_over_count()
            return True
        entry.dead = True
        entry.tomb = True
        self.maybe_free(entry)
        return False

    # ------------------------------------------------------------------ reads

    def pin(self, keys: Sequence[str]) -> list[Entry | None]:
        pinned: list[Entry | None] = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                entry.pins += 1
                self.entries.move_to_end(key)
            pinned.append(entry)
        return pinned

    def unpin(
        self,
        entries: Sequence[Entry | None],
        ok: Sequence[bool],
        read: Sequence[bool] | None = None,
        *,
        counted: bool = True,
    ) -> None:
        """Release pins; count hits and misses (unless not ``counted``: nobody asked for the
        pages); drop a pinned page that failed verification (``read``: which entries were read
        at all; default every one)."""
        for i, (entry, good) in enumerate(zip(entries, ok, strict=True)):
            if counted and good:
                self.hits += 1
            elif counted:
                self.misses += 1
            if entry is None:
                continue
            entry.pins -= 1
            if good:
                entry.read_back = True
            elif not entry.dead and (read is None or read[i]):
                self.corrupt += 1
                log.warning("file backend %s: page %r failed verification", self.root, entry.key)
                self.drop(entry, tombstone=True)
            self.maybe_free(entry)

    def stats(self) -> BackendStats:
        return BackendStats(
            pages=len(self.entries),
            bytes=self.payload,
            capacity_bytes=self.capacity,
            hits=self.hits,
            misses=self.misses,
            corrupt_pages=self.corrupt,
            evicted_pages=self.evicted,
        )
