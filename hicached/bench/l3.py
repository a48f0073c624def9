"""L3 throughput beside the machine's own limits, measured on the same pages in one run.

Pages are 64 KiB (one 16-token page of a small model), moved in batches of 128
(the reference's batch size). Every figure is GB/s (10**9 bytes per second):

* ``l3_file_write_gbps`` / ``l3_file_read_gbps``: the ``file`` backend,
  ``set_from`` then ``get_into`` straight into preallocated page buffers
  (page-aligned anonymous memory, as the daemon's L2 pages are: so the backend
  moves them with direct I/O, as it does in the daemon).
* ``disk_write_gbps`` / ``disk_read_gbps``: raw sequential ``writev``/``readv``
  of the same bytes into one plain file, in the same batches (the limit).
* ``l3_file_per_page_write_gbps``: the naive layout, one file per page.
* ``l3_restore_gbps``: a cold prefix restored through the content index, L3 ->
  L2 -> a worker buffer (:mod:`hicached.bench.l3_restore`).
* ``redis_set_gbps`` / ``redis_get_gbps``: redis-py (hiredis) pipelined
  SET/GET of the same pages into a local ``redis-server`` this benchmark
  starts and stops; ``l3_redis_set_gbps`` / ``l3_redis_get_gbps``: the same
  through the ``redis`` backend (framing and checksums included). Omitted,
  with a logged note, when ``redis-server`` is not installed.

Like with like. Raw disk, the file backend and the restore move the same
payload (the file backend adds its 512-byte slot header per page, 0.8% more
bytes, not credited) in the same batches from and into the same buffers. Every
write is timed up to an ``fdatasync`` of the files it wrote (the file backend
runs with ``fsync = false`` and one ``sync()`` at the end, the raw file with
one ``fdatasync`` at the end; for the per-page layout, of every page file), so
each write figure is the speed at which bytes become durable. Every read starts
cold: the files read are synced and dropped from the page cache with
``posix_fadvise(DONTNEED)`` first. Before the first repetition an untimed raw
write of the same size warms the page cache's allocator: the first large write
of a process measured 0.2-0.3 GB/s against 0.8-1.4 GB/s for the next ones.

Raw disk, the file backend and the restore run five times, rotating which
goes first; each figure is a median and ``l3_file_{write,read}_vs_disk`` /
``l3_restore_vs_disk`` are medians of the ratios within one repetition (the
restore against that repetition's raw read).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import shutil
import statistics
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hicached.bench import missing_package, missing_program
from hicached.bench.l3_restore import SPEC, host_group, restore_gbps
from hicached.bench.timing import drop_cache, gbps, timed
from hicached.l2 import HostPoolGroup
from hicached.l3.file import FileBackend, FileBackendConfig
from hicached.testing.servers import redis_server

log = logging.getLogger(__name__)

PAGE_BYTES = SPEC.page_bytes  # 64 KiB
BATCH = 128
DISTINCT_PAGES = 512  # source pages cycled through; keys are all distinct


def _page_aligned(nbytes: int) -> memoryview:
    """``nbytes`` of anonymous memory from a page boundary, faulted in: the daemon's L2 pages
    are such memory (a bytearray's is not sector-aligned, so the file backend's direct I/O
    would refuse it and go through the page cache, which the daemon never does)."""
    view = memoryview(mmap.mmap(-1, nbytes))
    view[:] = bytes(nbytes)
    return view


class _Pages:
    """``n`` pages cycled from a small set of random sources, in batches."""

    def __init__(self, n: int, source: memoryview | None = None) -> None:
        self.n = n
        if source is None:
            source = _page_aligned(DISTINCT_PAGES * PAGE_BYTES)
            source[:] = os.urandom(len(source))
        self.source = source
        self.dest = _page_aligned(BATCH * PAGE_BYTES)

    def page(self, i: int) -> memoryview:
        j = i % DISTINCT_PAGES
        return self.source[j * PAGE_BYTES : (j + 1) * PAGE_BYTES]

    def batches(self) -> Iterator[range]:
        for start in range(0, self.n, BATCH):
            yield range(start, min(start + BATCH, self.n))

    def dest_chunks(self, count: int) -> list[memoryview]:
        return [self.dest[k * PAGE_BYTES : (k + 1) * PAGE_BYTES] for k in range(count)]

    @property
    def nbytes(self) -> int:
        return self.n * PAGE_BYTES


def _raw_disk(pages: _Pages, path: Path) -> dict[str, float]:
    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for batch in pages.batches():
                os.writev(fd, [pages.page(i) for i in batch])
            os.fdatasync(fd)
        finally:
            os.close(fd)

    write_s = timed(write)
    drop_cache([path])

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for batch in pages.batches():
                want = len(batch) * PAGE_BYTES
                if os.readv(fd, pages.dest_chunks(len(batch))) != want:
                    raise RuntimeError(f"short read from {path}")
        finally:
            os.close(fd)

    read_s = timed(read)
    return {"disk_write_gbps": gbps(pages.nbytes, write_s), "disk_read_gbps": gbps(pages.nbytes, read_s)}


def _l3_file(pages: _Pages, root: Path) -> dict[str, float]:
    backend = FileBackend(FileBackendConfig(path=str(root), capacity_bytes=4 * pages.nbytes))
    try:
        keys = [f"bench/{i:08d}" for i in range(pages.n)]

        def write() -> None:
            for batch in pages.batches():
                ok = backend.set_from([keys[i] for i in batch], [[pages.page(i)] for i in batch])
                if not all(ok):
                    raise RuntimeError("file backend refused a page during the benchmark")
            backend.sync()

        write_s = timed(write)
        drop_cache(sorted(root.glob("slab-*.dat")))

        def read() -> None:
            for batch in pages.batches():
                dests = [[chunk] for chunk in pages.dest_chunks(len(batch))]
                if not all(backend.get_into([keys[i] for i in batch], dests)):
                    raise RuntimeError("file backend missed a page during the benchmark")

        read_s = timed(read)
    finally:
        backend.close()
    return {
        "l3_file_write_gbps": gbps(pages.nbytes, write_s),
        "l3_file_read_gbps": gbps(pages.nbytes, read_s),
    }


def _per_page_files(pages: _Pages, root: Path) -> dict[str, float]:
    root.mkdir()
    paths = [root / f"{i:08d}.page" for i in range(pages.n)]

    def write() -> None:
        for i, path in enumerate(paths):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, pages.page(i))
            finally:
                os.close(fd)
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)

    return {"l3_file_per_page_write_gbps": gbps(pages.nbytes, timed(write))}


def _redis(pages: _Pages, workdir: Path) -> dict[str, float]:
    import redis

    from hicached.l3.redis import RedisBackend, RedisBackendConfig

    out: dict[str, float] = {}
    with redis_server(parent=workdir) as srv:
        client: Any = redis.Redis(host=srv.host, port=srv.port)
        keys = [f"raw/{i:08d}" for i in range(pages.n)]

        def raw_set() -> None:
            for batch in pages.batches():
                pipe = client.pipeline(transaction=False)
                for i in batch:
                    pipe.set(keys[i], pages.page(i))
                pipe.execute()

        def raw_get() -> None:
            for batch in pages.batches():
                pipe = client.pipeline(transaction=False)
                for i in batch:
                    pipe.get(keys[i])
                if any(v is None for v in pipe.execute()):
                    raise RuntimeError("redis lost a page during the benchmark")

        out["redis_set_gbps"] = gbps(pages.nbytes, timed(raw_set))
        out["redis_get_gbps"] = gbps(pages.nbytes, timed(raw_get))
        client.flushdb()
        client.close()

        backend = RedisBackend(RedisBackendConfig(host=srv.host, port=srv.port, batch_pages=BATCH))
        try:
            lkeys = [f"l3/{i:08d}" for i in range(pages.n)]

            def l3_set() -> None:
                for batch in pages.batches():
                    if not all(backend.set_from([lkeys[i] for i in batch], [[pages.page(i)] for i in batch])):
                        raise RuntimeError("redis backend refused a page during the benchmark")

            def l3_get() -> None:
                for batch in pages.batches():
                    dests = [[chunk] for chunk in pages.dest_chunks(len(batch))]
                    if not all(backend.get_into([lkeys[i] for i in batch], dests)):
                        raise RuntimeError("redis backend missed a page during the benchmark")

            out["l3_redis_set_gbps"] = gbps(pages.nbytes, timed(l3_set))
            out["l3_redis_get_gbps"] = gbps(pages.nbytes, timed(l3_get))
        finally:
            backend.close()
    return out


def _restore(pages: _Pages, group: HostPoolGroup | None, root: Path) -> dict[str, float]:
    if group is None:
        return {}
    return {"l3_restore_gbps": restore_gbps(group, pages.source, pages.n, root)}


def _paired_file_runs(
    pages: _Pages, scratch: Path, reps: int, group: HostPoolGroup | None = None
) -> dict[str, float]:
    """Raw disk, the file backend (and, given a host pool group, the restore), rotating
    which goes first, ``reps`` times.

    Reports the median of each figure and the median of the per-repetition
    ratios (each ratio pairs measurements taken in the same repetition).
    """
    warm = scratch / "warm-up.dat"
    _raw_disk(pages, warm)
    warm.unlink()
    samples: dict[str, list[float]] = {}
    for rep in range(reps):
        raw_path, l3_root, restore_root = (
            scratch / f"raw-{rep}.dat",
            scratch / f"l3-{rep}",
            scratch / f"r-{rep}",
        )
        steps = [
            functools.partial(_raw_disk, pages, raw_path),
            functools.partial(_l3_file, pages, l3_root),
            functools.partial(_restore, pages, group, restore_root),
        ]
        figures: dict[str, float] = {}
        for step in steps[rep % 3 :] + steps[: rep % 3]:
            figures.update(step())
        raw_path.unlink()
        shutil.rmtree(l3_root)
        shutil.rmtree(restore_root, ignore_errors=True)
        figures["l3_file_write_vs_disk"] = figures["l3_file_write_gbps"] / figures["disk_write_gbps"]
        figures["l3_file_read_vs_disk"] = figures["l3_file_read_gbps"] / figures["disk_read_gbps"]
        if "l3_restore_gbps" in figures:
            figures["l3_restore_vs_disk"] = figures["l3_restore_gbps"] / figures["disk_read_gbps"]
        for name, value in figures.items():
            samples.setdefault(name, []).append(value)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(quick: bool, workdir: Path | None = None) -> dict[str, float]:
    """L3 file and redis throughput beside raw disk and plain redis-py (GB/s).

    Scratch files go to a fresh directory under ``workdir`` (default: the
    system temp directory), removed before returning.
    """
    if workdir is None:
        workdir = Path(tempfile.gettempdir())
    total = (256 << 20) if quick else (1 << 30)
    pages = _Pages(total // PAGE_BYTES)
    per_page = _Pages(min(pages.n, 2048), pages.source)
    scratch = workdir / f"bench-l3-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    scratch.mkdir(parents=True)
    results: dict[str, float] = {}
    try:
        with host_group(pages.n) as group:
            results.update(_paired_file_runs(pages, scratch, reps=5, group=group))
        results.update(_per_page_files(per_page, scratch / "per-page"))
        why_not = missing_program("redis-server", "Debian package redis-server") or missing_package("redis")
        if why_not:
            log.warning("redis_* figures omitted: %s", why_not)
        else:
            results.update(_redis(pages, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results
