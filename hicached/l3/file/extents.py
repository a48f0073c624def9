"""Which slots of a slab file the start-up scan reads: only those whose header holds data.

A slab file is sparse wherever slots were never written: a large capacity written sparsely, a
file extended by truncation, a foreign or damaged file. A hole reads as zeros, and a zeroed
header is a free slot's, so reading it tells the scan nothing; ``lseek`` with
``SEEK_DATA``/``SEEK_HOLE`` lists the data extents and only slots whose 512 header bytes meet one
are read. Measured on ext4, a 1 GiB slab file of 4 KiB pages holding 12 pages: reading every
header took 2.3 s (0.38 s once cached) and filled the page cache with 1 GiB of zeroed pages;
skipping the holes, 0.03 s and 60 KiB.

Where the platform or filesystem cannot list extents (no ``SEEK_DATA``, or ``lseek`` answers
EINVAL / EOPNOTSUPP) every slot is read, as before: correct, only slower on holes, and logged at
debug level (a documented fallback, not a fault). A filesystem without its own support that
takes the kernel's generic ``lseek`` reports the whole file as data: the same full scan.

Functions over a descriptor the caller owns; ``lseek`` moves its file offset, which the backend
never uses (every read and write names its offset), so they are safe beside other I/O on it.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from hicached.l3.file.layout import HEADER_BYTES

__all__ = ["data_extents", "header_slots", "slots_meeting"]

log = logging.getLogger(__name__)

# lseek's answers when the filesystem (or kernel) does not support SEEK_DATA / SEEK_HOLE.
_UNSUPPORTED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


def data_extents(fd: int, file_bytes: int) -> list[tuple[int, int]] | None:
    """The ``[start, end)`` byte ranges of the first ``file_bytes`` of ``fd`` that hold data,
    ascending and disjoint; None where the filesystem cannot tell (then all of it may).

    An error other than "unsupported" is raised, as a failed read of the file would be.
    """
    seek_data = getattr(os, "SEEK_DATA", None)
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_data is None or seek_hole is None:
        return None
    extents: list[tuple[int, int]] = []
    offset = 0
    while offset < file_bytes:
        try:
            start = os.lseek(fd, offset, seek_data)
            end = os.lseek(fd, start, seek_hole)  # the end of the file counts as a hole
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data at or after offset
                break
            if exc.errno in _UNSUPPORTED:
                return None
            raise
        if start < offset or end <= start:  # not an answer a filesystem gives; a full scan is safe
            return None
        extents.append((start, min(end, file_bytes)))
        offset = end
    return extents


def header_slots(fd: int, slot_bytes: int, file_bytes: int, path: Path) -> Iterable[int]:
    """The slots, ascending and each once, whose header may hold data, of the slab file ``fd``
    (``path``) of ``file_bytes`` bytes with ``slot_bytes`` slots, the last one possibly cut
    short. Every other slot's header is a hole: all zeros, a never-written (free) slot."""
    nslots = -(-file_bytes // slot_bytes)
    extents = data_extents(fd, file_bytes)
    if extents is None:
        log.debug("file backend: %s cannot list its holes (SEEK_DATA); every slot header is read", path)
        return range(nslots)
    return slots_meeting(extents, slot_bytes, nslots)


def slots_meeting(extents: Iterable[tuple[int, int]], slot_bytes: int, nslots: int) -> Iterator[int]:
    """The slots below ``nslots``, ascending and each once, whose header bytes meet one of the
    ascending, disjoint byte ranges ``extents``."""
    after = 0  # slots below this were yielded already (a header can meet two extents)
    for start, end in extents:
        # The header of slot s is [s * slot_bytes, s * slot_bytes + HEADER_BYTES): it meets
        # [start, end) when it begins before end and ends after start.
        first = max(after, (start - HEADER_BYTES) // slot_bytes + 1)
        stop = min(nslots, -(-end // slot_bytes))
        yield from range(first, stop)
        after = max(after, stop)
