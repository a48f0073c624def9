"""Slab files of equal-size slots, their free-slot allocators, and the index entries.

Not thread-safe: the backend's lock guards every allocator and every entry's
mutable fields (``pins``, ``dead``, ``tomb``, ``freed``).
"""

from __future__ import annotations

import dataclasses
import heapq
import os
from pathlib import Path

__all__ = ["Entry", "Slab"]


class Slab:
    """One file of equal-size slots and its free-slot allocator (guarded by the backend lock)."""

    def __init__(self, path: Path, slot_bytes: int) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.free: list[int] = []  # min-heap: low slots first keeps batches adjacent
        self.high = 0  # slots at or above this index were never handed out

    def alloc(self) -> int:
        if self.free:
            return heapq.heappop(self.free)
        self.high += 1
        return self.high - 1

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def alloc_on_disk(self) -> int | None:
        """A free slot that lies wholly inside the file (its blocks exist: a write there needs
        no new disk space), or None."""
        if self.free and self.offset(self.free[0] + 1) <= os.fstat(self.fd).st_size:
            return heapq.heappop(self.free)
        return None


@dataclasses.dataclass(eq=False, slots=True)
class Entry:
    """One stored page. ``checksum`` is set once, before the entry is indexed; the other
    fields but pins/dead/tomb/freed never change."""

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
