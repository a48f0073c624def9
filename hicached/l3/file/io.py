"""Vectored slot I/O of the file backend: runs of adjacent slots in one syscall.

Pages are written and read at offsets with ``pwritev``/``preadv``; a batch whose
slots are adjacent moves in one syscall per run straight between the caller's
chunks and the file (no staging copy). Runs of one batch are issued on a small
thread pool (the GIL is released during syscalls and payload hashing).

Direct I/O. Where the slab has an ``O_DIRECT`` descriptor and every page and
chunk of a run is a whole number of sectors, the run is written or read past the
page cache (headers in an aligned per-thread scratch buffer): the daemon's L2 is
already the copy in memory, and on our VMs page-cache memory the kernel has not
used lately is slow to take (measured in docs/performance.md). The kernel checks
the buffers' alignment before any I/O; a run it refuses (EINVAL) goes through the
page cache. Where its buffers were aligned, the disk's sectors are larger than
512 bytes: the slab then sends only runs whose offset and length are whole
4 KiB sectors (:meth:`Slab.direct_refused`). Single pages read as bytes
(``get``) always go through the page cache.

Thread-safety: the functions here touch only the buffers and entries they are
given (entries pinned or not yet indexed, so no other thread frees their slots);
:class:`IoPool` is thread-safe.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from hicached.errors import InvalidArgument
from hicached.l3.file.layout import HEADER_BYTES, SLOT_ALIGN, ZEROS, header_matches, pack_header
from hicached.l3.file.slabs import SECTOR_BYTES, Entry, Slab
from hicached.l3.framing import payload_checksum

__all__ = ["IoPool", "as_bytes_view", "read_run", "runs", "write_run"]

log = logging.getLogger(__name__)

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
# Linux moves at most 0x7ffff000 bytes per call; stay far below.
MAX_IO_BYTES = 256 << 20

_scratch_local = threading.local()

T = TypeVar("T")
R = TypeVar("R")
Run = list[tuple[int, Entry]]  # (index in the caller's batch, entry), adjacent slots of one slab


class IoPool:
    """``fn`` over items on up to ``threads`` threads, created on first use. Thread-safe."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        if len(items) < 2 or self.threads < 2:
            return [fn(item) for item in items]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
            pool = self._pool
        return list(pool.map(fn, items))

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def as_bytes_view(buf: bytes | bytearray | memoryview, *, writable: bool) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidArgument(f"page buffer must be bytes-like, got {type(buf).__name__}") from None
    if writable and view.readonly:
        raise InvalidArgument("destination chunk is read-only")
    if not view.c_contiguous:
        raise InvalidArgument("page chunk is not C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _vectored(op: Callable[[int, list[Any], int], int], fd: int, iov: list[Any], offset: int) -> int:
    """Run ``preadv``/``pwritev`` over ``iov`` in groups of at most IOV_MAX buffers.

    Returns the bytes moved; stops at the first short transfer (end of file,
    disk full), so everything below the returned count was moved.
    """
    if len(iov) <= _IOV_MAX:  # one call (a run of a batch always is): its count says it all
        return op(fd, iov, offset)
    done = 0
    for start in range(0, len(iov), _IOV_MAX):
        group = iov[start : start + _IOV_MAX]
        want = sum(memoryview(b).nbytes for b in group)
        got = op(fd, group, offset + done)
        done += got
        if got != want:
            break
    return done


def runs(plan: Run, max_bytes: int = MAX_IO_BYTES) -> Iterator[Run]:
    """Group pages into runs of adjacent slots of one slab, of at most ``max_bytes``
    (or one slot)."""
    plan = sorted(plan, key=lambda p: (p[1].slab.slot_bytes, p[1].slot))
    run: Run = []
    nbytes = 0
    for item in plan:
        entry = item[1]
        if run:
            last = run[-1][1]
            adjacent = last.slab is entry.slab and last.slot + 1 == entry.slot
            if not adjacent or nbytes + entry.slab.slot_bytes > max_bytes:
                yield run
                run, nbytes = [], 0
        run.append(item)
        nbytes += entry.slab.slot_bytes
    if run:
        yield run


def read_run(run: Run, views: Sequence[Sequence[memoryview]], ok: list[bool], root: Path) -> None:
    """Read one run into the callers' chunks in one vectored call and verify each page;
    sets ``ok[i]`` for the pages read whole and verified."""
    slab = run[0][1].slab
    sink = bytearray(SLOT_ALIGN)
    direct = _direct_ok(run, views)
    if direct:
        arena = _scratch(len(run) * HEADER_BYTES)
        headers: list[memoryview | bytearray] = [
            arena[n * HEADER_BYTES : (n + 1) * HEADER_BYTES] for n in range(len(run))
        ]
    else:
        headers = [bytearray(HEADER_BYTES) for _ in run]
    iov: list[memoryview | bytearray] = []
    for n, (i, entry) in enumerate(run):
        iov.append(headers[n])
        iov.extend(views[i])
        gap = slab.slot_bytes - HEADER_BYTES - entry.length
        if n + 1 < len(run) and gap:
            iov.append(memoryview(sink)[:gap])
    want = _run_bytes(run)
    try:
        got = _vectored_run(os.preadv, slab, iov, slab.offset(run[0][1].slot), direct)
    except OSError as exc:
        log.warning("file backend %s: read of %d pages failed: %s", root, len(run), exc)
        got = -1
    if got != want and len(run) > 1:
        for item in run:  # short read (file truncated under us): page by page
            read_run([item], views, ok, root)
        return
    for n, (i, entry) in enumerate(run):
        ok[i] = got == want and verify(entry, headers[n], views[i])


def verify(entry: Entry, header: bytes | bytearray | memoryview, chunks: Sequence[memoryview]) -> bool:
    return header_matches(
        header, chunks, key=entry.key, seq=entry.seq, length=entry.length, checksum=entry.checksum
    )


def _scratch(nbytes: int) -> memoryview:
    """This thread's page-aligned scratch buffer of at least ``nbytes`` (valid until the thread's
    next call: a run uses it only during its own syscall)."""
    buf: mmap.mmap | None = getattr(_scratch_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = mmap.mmap(-1, max(nbytes, 64 << 10))
        _scratch_local.buf = buf
    return memoryview(buf)[:nbytes]


def _run_bytes(run: Run) -> int:
    """The bytes of the file one run spans (up to its last page's payload)."""
    return run[0][1].slab.slot_bytes * (len(run) - 1) + HEADER_BYTES + run[-1][1].length


def _direct_ok(run: Run, bufs: Sequence[Sequence[memoryview]]) -> int:
    """The sector alignment the run is sent with on the slab's ``O_DIRECT`` descriptor, or 0
    (through the page cache): every payload and chunk a whole number of 512-byte sectors (so no
    padding between slots either), the run's offset and length of the slab's ``direct_align``.
    Addresses the kernel checks."""
    slab = run[0][1].slab
    align = slab.direct_align
    if not align:  # no O_DIRECT descriptor, or the disk refused it
        return 0
    if slab.offset(run[0][1].slot) % align or _run_bytes(run) % align:
        return 0
    ok = all(
        entry.length % SECTOR_BYTES == 0 and all(c.nbytes % SECTOR_BYTES == 0 for c in bufs[i])
        for i, entry in run
    )
    return align if ok else 0


def _addresses_aligned(iov: list[Any]) -> bool:
    return all(np.frombuffer(buf, dtype=np.uint8).ctypes.data % SECTOR_BYTES == 0 for buf in iov)


def _vectored_run(
    op: Callable[[int, list[Any], int], int], slab: Slab, iov: list[Any], offset: int, direct: int
) -> int:
    """``preadv``/``pwritev`` of one run, on the slab's ``O_DIRECT`` descriptor when ``direct``
    (the alignment :func:`_direct_ok` checked)."""
    if direct:
        assert slab.direct_fd is not None
        try:
            return _vectored(op, slab.direct_fd, iov, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Refused before any I/O: a caller's unaligned buffer (expected: the documented
            # fallback), or, where every buffer was aligned, a disk with larger sectors.
            if _addresses_aligned(iov):
                slab.direct_refused(direct)
    return _vectored(op, slab.fd, iov, offset)


def write_run(
    run: Run, srcs: Sequence[Sequence[memoryview]], encoded: Sequence[bytes], *, root: Path
) -> tuple[list[int], bool]:
    """Checksum and write one run of adjacent slots in one vectored call: the batch indices
    written whole, and whether the disk was full (ENOSPC/EDQUOT or a short write).

    Sets each entry's ``checksum`` (the entries are not indexed yet: nobody else reads it).
    """
    slab = run[0][1].slab
    direct = _direct_ok(run, srcs)
    headers = _scratch(len(run) * HEADER_BYTES) if direct else None
    iov: list[bytes | memoryview] = []
    ends: list[tuple[int, int]] = []
    pos = 0
    for n, (i, entry) in enumerate(run):
        entry.checksum = payload_checksum(srcs[i])
        header: bytes | memoryview = pack_header(encoded[i], entry.seq, entry.length, entry.checksum)
        if headers is not None:
            headers[n * HEADER_BYTES : (n + 1) * HEADER_BYTES] = header
            header = headers[n * HEADER_BYTES : (n + 1) * HEADER_BYTES]
        iov.append(header)
        iov.extend(srcs[i])
        pos += HEADER_BYTES + entry.length
        ends.append((i, pos))
        gap = slab.slot_bytes - HEADER_BYTES - entry.length
        if n + 1 < len(run) and gap:
            iov.append(ZEROS[:gap])
            pos += gap
    try:
        done = _vectored_run(os.pwritev, slab, iov, slab.offset(run[0][1].slot), direct)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return [], True  # a full disk is a capacity, not a fault (the caller evicts)
        log.warning("file backend %s: write of %d pages failed: %s", root, len(run), exc)
        return [], False
    return [i for i, end in ends if end <= done], done < pos
