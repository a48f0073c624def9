"""The ``file`` backend's direct I/O: aligned runs are written and read past the page cache, the
rest through it, and both read back right whatever was in a slot before.

Whether a file's pages are in the page cache is asked of the kernel (``mincore`` on a mapping
of the slab file), before anything reads them.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hicached.bench.timing import drop_cache
from hicached.l3 import create_backend
from hicached.l3.file import FileBackend, slot_bytes_for
from tests.support.mounts import attach_loop, detach_loop, mount, unmount

PAGE = 64 << 10
OS_PAGE = mmap.PAGESIZE


def open_file(path: Path, **extra: object) -> FileBackend:
    backend = create_backend("file", {"path": str(path), "capacity_bytes": 64 << 20, **extra})
    assert isinstance(backend, FileBackend)
    return backend


def resident_bytes(file: Path) -> int:
    """Bytes of ``file`` the page cache holds now (``mincore``; maps it without touching it)."""
    size = file.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with file.open("r+b") as f, mmap.mmap(f.fileno(), size) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)
        vec = (ctypes.c_ubyte * (-(-size // OS_PAGE)))()
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        assert rc == 0, f"mincore failed: errno {ctypes.get_errno()}"
        del view
    return sum(b & 1 for b in vec) * OS_PAGE


def drop_cached(file: Path) -> None:
    drop_cache([file])
    assert resident_bytes(file) == 0


def aligned_pages(count: int, *, offset: int = 0) -> tuple[mmap.mmap, list[memoryview]]:
    """``count`` distinct pages in one anonymous mapping, starting ``offset`` bytes past a
    page boundary (0: every page sector-aligned, as the daemon's L2 pages are)."""
    area = mmap.mmap(-1, count * PAGE + OS_PAGE)
    view = memoryview(area)
    pages = [view[offset + i * PAGE : offset + (i + 1) * PAGE] for i in range(count)]
    for i, page in enumerate(pages):
        np.frombuffer(page, dtype=np.uint8)[:] = np.arange(PAGE, dtype=np.uint64).astype(np.uint8) ^ i
    return area, pages


@pytest.mark.parametrize("direct", [True, False])
def test_aligned_pages_skip_the_page_cache_only_when_direct(file_dir: Path, direct: bool) -> None:
    keys = [f"d/{i}" for i in range(8)]
    _area, pages = aligned_pages(len(keys))
    with open_file(file_dir, direct_io=direct) as backend:
        assert backend.set_from(keys, [[p] for p in pages]) == [True] * len(keys)
        slab = file_dir / f"slab-{slot_bytes_for(PAGE)}.dat"
        cached = resident_bytes(slab)
        if direct:
            assert cached == 0, f"{cached} bytes of a direct write are in the page cache"
        else:
            assert cached >= len(keys) * PAGE
        assert backend.get(keys) == [bytes(p) for p in pages]
    with open_file(file_dir, direct_io=direct) as backend:  # the start-up scan reads the headers
        assert backend.get(keys) == [bytes(p) for p in pages]


@pytest.mark.parametrize("direct", [True, False])
def test_aligned_reads_skip_the_page_cache_only_when_direct(file_dir: Path, direct: bool) -> None:
    keys = [f"g/{i}" for i in range(8)]
    _area, pages = aligned_pages(len(keys))
    _dest, dests = aligned_pages(len(keys))
    slab = file_dir / f"slab-{slot_bytes_for(PAGE)}.dat"
    with open_file(file_dir, direct_io=direct) as backend:
        assert backend.set_from(keys, [[p] for p in pages]) == [True] * len(keys)
        drop_cached(slab)
        assert backend.get_into(keys, [[d] for d in dests]) == [True] * len(keys)
        cached = resident_bytes(slab)
        if direct:
            assert cached == 0, f"{cached} bytes of a direct read are in the page cache"
        else:
            assert cached >= len(keys) * PAGE
        assert [bytes(d) for d in dests] == [bytes(p) for p in pages]


def test_unaligned_buffers_go_through_the_page_cache(file_dir: Path) -> None:
    """The kernel refuses direct I/O on a buffer that is not sector-aligned (EINVAL, before
    any I/O): the run is written, and read, through the page cache instead."""
    keys = [f"u/{i}" for i in range(8)]
    _area, pages = aligned_pages(len(keys), offset=8)
    slab = file_dir / f"slab-{slot_bytes_for(PAGE)}.dat"
    with open_file(file_dir) as backend:
        assert backend.set_from(keys, [[p] for p in pages]) == [True] * len(keys)
        assert resident_bytes(slab) >= len(keys) * PAGE
        drop_cached(slab)
        _dest, dests = aligned_pages(len(keys), offset=8)
        assert backend.get_into(keys, [[d] for d in dests]) == [True] * len(keys)
        assert resident_bytes(slab) >= len(keys) * PAGE
        assert [bytes(d) for d in dests] == [bytes(p) for p in pages]


@pytest.mark.parametrize("first_direct", [True, False])
def test_a_reused_slot_reads_the_last_write_whichever_path_wrote_it(
    file_dir: Path, first_direct: bool
) -> None:
    """A page written through the page cache, deleted, and its slot written directly (or the
    other way round) reads back as the second page: no stale cached copy is served."""
    _a, aligned = aligned_pages(2)
    _b, unaligned = aligned_pages(2, offset=8)
    first, second = (aligned[0], unaligned[1]) if first_direct else (unaligned[0], aligned[1])
    slab = file_dir / f"slab-{slot_bytes_for(PAGE)}.dat"
    with open_file(file_dir) as backend:
        assert backend.set_from(["r/first"], [[first]]) == [True]
        assert backend.get(["r/first"]) == [bytes(first)]  # now in the page cache, whichever path
        assert backend.delete(["r/first"]) == 1
        assert backend.set_from(["r/second"], [[second]]) == [True]
        assert slab.stat().st_size == slot_bytes_for(PAGE)  # the one slot, reused
        assert backend.get(["r/second"]) == [bytes(second)]
        dest = bytearray(PAGE)
        assert backend.get_into(["r/second"], [[memoryview(dest)]]) == [True]
        assert bytes(dest) == bytes(second)
        assert backend.get(["r/first"]) == [None]


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs mounted at a fresh directory: a filesystem that refuses ``O_DIRECT`` (EINVAL)."""
    target = tmp_path / "ramfs"
    target.mkdir()
    why = mount(target, "-t", "ramfs", "ramfs")
    if why is not None:
        pytest.fail(f"cannot mount a ramfs (CI runs as root): {why}")
    try:
        yield target
    finally:
        unmount(target)


def test_a_filesystem_that_refuses_direct_io_is_logged_and_used_through_the_page_cache(
    ramfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [f"f/{i}" for i in range(8)]
    _area, pages = aligned_pages(len(keys))
    with caplog.at_level(logging.WARNING, logger="hicached.l3.file"), open_file(ramfs / "l3") as backend:
        assert backend.set_from(keys, [[p] for p in pages]) == [True] * len(keys)
        _dest, dests = aligned_pages(len(keys))
        assert backend.get_into(keys, [[d] for d in dests]) == [True] * len(keys)
        assert [bytes(d) for d in dests] == [bytes(p) for p in pages]
    refusals = [r.getMessage() for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(refusals) == 1, refusals  # once for the one slab file, not per run
    assert f"slab-{slot_bytes_for(PAGE)}.dat" in refusals[0]
    assert "page cache" in refusals[0]


@pytest.fixture
def disk_4kn(tmp_path: Path) -> Iterator[Path]:
    """An ext4 filesystem on a loop device with 4 KiB logical sectors (a "4Kn" disk), mounted at
    a fresh directory: it refuses direct I/O whose offset or length is not a whole 4 KiB."""
    image, target = tmp_path / "disk.img", tmp_path / "4kn"
    with image.open("wb") as f:
        f.truncate(64 << 20)
    target.mkdir()
    device = attach_loop(image, sector_bytes=4096)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-b", "4096", device], check=True)
        why = mount(target, device)
        if why is not None:
            pytest.fail(f"cannot mount the loop device (CI runs as root): {why}")
        try:
            yield target
        finally:
            unmount(target)
    finally:
        detach_loop(device)


def test_a_disk_with_4k_sectors_is_learned_once_and_every_page_reads_back(
    disk_4kn: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a 4 KiB-sector disk a run of 8 slots from slot 0 is whole sectors and goes direct; the
    first run that is not is refused, logged once, and from then on such runs go through the
    page cache without asking the disk again. Every page reads back, also after a restart."""
    slot = slot_bytes_for(PAGE)
    assert (8 * slot) % 4096 == 0 and slot % 4096 != 0  # the layout this test relies on
    _area, pages = aligned_pages(12)
    keys = [f"k/{i}" for i in range(12)]
    slab = disk_4kn / "l3" / f"slab-{slot}.dat"
    with caplog.at_level(logging.WARNING, logger="hicached.l3.file"), open_file(disk_4kn / "l3") as backend:
        assert backend.set_from(keys[:8], [[p] for p in pages[:8]]) == [True] * 8  # slots 0-7
        assert resident_bytes(slab) == 0  # whole 4 KiB sectors: written directly
        for key, page in zip(keys[8:], pages[8:], strict=True):  # slots 8-11, one run each
            assert backend.set_from([key], [[page]]) == [True]
        assert resident_bytes(slab) >= 4 * PAGE
        drop_cached(slab)
        _dest, dests = aligned_pages(12)
        assert backend.get_into(keys[:8], [[d] for d in dests[:8]]) == [True] * 8
        assert resident_bytes(slab) == 0  # read directly
        assert backend.get_into(keys[8:], [[d] for d in dests[8:]]) == [True] * 4
        assert [bytes(d) for d in dests] == [bytes(p) for p in pages]
    refusals = [r.getMessage() for r in caplog.records if "refused direct I/O" in r.getMessage()]
    assert len(refusals) == 1, refusals
    assert "aligned to 512 bytes" in refusals[0] and "not aligned to 4096 bytes" in refusals[0]
    with open_file(disk_4kn / "l3") as backend:
        assert backend.get(keys) == [bytes(p) for p in pages]
