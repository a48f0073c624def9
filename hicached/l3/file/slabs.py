"""Slab files of equal-size slots, their free-slot allocators, and the index entries.

Not thread-safe: the backend's lock guards every allocator and every entry's
mutable fields (``pins``, ``dead``, ``tomb``, ``freed``); a slab's ``direct_align``
is the one field I/O threads write (see :meth:`Slab.direct_refused`).
"""

from __future__ import annotations

import dataclasses
import errno
import heapq
import logging
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["LARGE_SECTOR_BYTES", "SECTOR_BYTES", "Entry", "Slab"]

log = logging.getLogger(__name__)

# Direct I/O needs buffers, lengths and offsets in whole sectors: 512 bytes on most disks, 4 KiB
# on "4Kn" disks (which refuse a 512-aligned run: EINVAL, and the slab learns the larger size).
SECTOR_BYTES = 512
LARGE_SECTOR_BYTES = 4096


class Slab:
    """One file of equal-size slots and its free-slot allocator (guarded by the backend lock)."""

    def __init__(self, path: Path, slot_bytes: int, *, direct_io: bool = False) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        # Never through a symlink, nor into a FIFO or device someone put under a slab's name
        # (the start-up scan ignores those; a write of a new page size opened them).
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        # A second descriptor for runs moved past the page cache (see hicached.l3.file.io), or None.
        try:
            self.direct_fd = _open_direct(path) if direct_io else None
        except BaseException:
            os.close(self.fd)
            raise
        # The alignment of a run's file offset and length that the disk takes directly (0: no
        # direct I/O). Learned from refusals (no portable way to ask a filesystem for its sectors).
        self.direct_align = SECTOR_BYTES if self.direct_fd is not None else 0
        self._learning = threading.Lock()
        # The free slots below ``high``: those released while running in ``free``, a min-heap (low
        # slots first keeps batches adjacent), and those the start-up scan found free in
        # ``free_runs``, ranges kept highest first. A run costs one object where a sparse file's
        # never-written slots cost ~40 bytes each as ints (82 MB for 1 GiB of 512-byte slots).
        # The two are disjoint: a released slot was handed out, so it is in no run.
        self.free: list[int] = []
        self._in_free: set[int] = set()  # the slots in ``free``, for trim's check of the top one
        self.free_runs: list[range] = []
        self.high = 0  # slots at or above this index were never handed out (or were trimmed)

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)

    def direct_refused(self, align: int) -> None:
        """The disk refused a direct run aligned to ``align`` bytes, its buffers aligned too: its
        sectors are larger. Runs then need :data:`LARGE_SECTOR_BYTES` alignment, and after a
        refusal of that the slab stops using direct I/O; each step is logged once.

        Called from I/O threads without the backend lock: runs refused at once take the step
        under the slab's own lock, once; readers of the attribute (one int) need no lock.
        """
        with self._learning:
            if align != self.direct_align:
                return  # another run learned it already
            learned = self.direct_align = LARGE_SECTOR_BYTES if align < LARGE_SECTOR_BYTES else 0
        then = (
            f"runs not aligned to {learned} bytes go through the page cache"
            if learned
            else "its pages go through the page cache"
        )
        log.warning(
            "file backend: the disk under %s refused direct I/O aligned to %d bytes (larger sectors); %s",
            self.path,
            align,
            then,
        )

    def restore(self, high: int, used: Iterable[int]) -> None:
        """Set the allocator from the start-up scan of this slab's file, before anything is
        handed out: slots below ``high`` not in ``used`` are free, held as runs however many
        they are (``free`` keeps what was released)."""
        runs: list[range] = []
        after = 0
        for slot in sorted(used):
            if slot > after:
                runs.append(range(after, slot))
            after = slot + 1
        if after < high:
            runs.append(range(after, high))
        runs.reverse()
        self.free_runs = runs
        self.high = high

    def _lowest_free(self) -> int | None:
        """The lowest free slot below ``high``, or None."""
        if self.free_runs and (not self.free or self.free_runs[-1].start < self.free[0]):
            return self.free_runs[-1].start
        return self.free[0] if self.free else None

    def _take(self, slot: int) -> None:
        """Remove ``slot``, the one :meth:`_lowest_free` returned, from the free slots."""
        if self.free_runs and self.free_runs[-1].start == slot:
            rest = self.free_runs[-1][1:]
            if rest:
                self.free_runs[-1] = rest
            else:
                self.free_runs.pop()
        else:
            self._in_free.discard(heapq.heappop(self.free))

    def alloc(self) -> int:
        """The lowest free slot, else the next one never handed out."""
        slot = self._lowest_free()
        if slot is None:
            self.high += 1
            return self.high - 1
        self._take(slot)
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)
        self._in_free.add(slot)

    @property
    def file_bytes(self) -> int:
        """Bytes of the file that slots were handed out of: what this slab may hold on disk."""
        return self.high * self.slot_bytes

    def has_free(self) -> bool:
        """Whether :meth:`alloc` can reuse a slot (the file need not grow)."""
        return bool(self.free or self.free_runs)

    def trim(self) -> int:
        """Give the disk back the free slots at the end of the file: ``high`` drops below them
        and the file is truncated. Returns the bytes given back. Free slots lower down stay
        (this size reuses them first)."""
        top = self.high
        while self.high:
            if self.free_runs and self.free_runs[0].stop == self.high:  # the highest run
                self.high = self.free_runs.pop(0).start
            elif self.high - 1 in self._in_free:
                self._in_free.discard(self.high - 1)
                self.high -= 1
            else:
                break
        if self.high == top:
            return 0
        if len(self._in_free) != len(self.free):  # slots above ``high`` left the heap's set
            self.free = [s for s in self.free if s in self._in_free]
            heapq.heapify(self.free)
        if os.fstat(self.fd).st_size > self.file_bytes:
            os.ftruncate(self.fd, self.file_bytes)
        return (top - self.high) * self.slot_bytes

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def alloc_on_disk(self) -> int | None:
        """A free slot that lies wholly inside the file (its blocks exist: a write there needs
        no new disk space), or None."""
        slot = self._lowest_free()
        if slot is None or self.offset(slot + 1) > os.fstat(self.fd).st_size:
            return None
        self._take(slot)
        return slot


def _open_direct(path: Path) -> int | None:
    """``path`` opened for ``O_DIRECT``, or None (logged) where the filesystem refuses it
    (EINVAL, EOPNOTSUPP); any other error is raised."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        log.warning("file backend: no O_DIRECT on this platform; %s goes through the page cache", path)
        return None
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC | flag)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise  # not a refusal of O_DIRECT (out of descriptors, say): the caller's error
        log.warning(
            "file backend: %s refuses O_DIRECT (%s); its pages go through the page cache", path, exc.strerror
        )
        return None


@dataclasses.dataclass(eq=False, slots=True)
class Entry:
    """One stored page. ``checksum`` is set once, before the entry is indexed; the other
    fields but pins/dead/tomb/freed/read_back never change."""

    key: str
    slab: Slab
    slot: int
    length: int
    checksum: int
    seq: int
    pins: int = 0
    dead: bool = False  # out of the index; its slot is freed once no reader pins it
    tomb: bool = False  # clear the slot header when freeing (deleted or corrupt page)
    freed: bool = False
    # Written or read back whole by this process; False for a page found at start, whose
    # payload a crash may have torn (the headers alone are read then): a set() reads it first.
    read_back: bool = True
