"""The file backend's start-up scan of sparse slab files: a hole is a free slot, never read.

Real slab files with real holes (pages written where the backend would put them, the file
extended past them without writing); ``os.pread`` and ``os.lseek`` are wrapped only to count the
scan's header reads or to play a filesystem that cannot list its holes.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from hicached.l3.file import HEADER_BYTES, slot_bytes_for
from hicached.l3.file.extents import slots_meeting
from hicached.l3.file.layout import pack_header, parse_header
from hicached.l3.file.slabs import Slab
from hicached.l3.framing import payload_checksum
from tests.support.mounts import mount, unmount

from .test_file import open_file, page, slab_path

PAYLOAD = 4096
SLOT = slot_bytes_for(PAYLOAD)
RUN = 4  # pages written at the start, in the middle and at the end of the slab

T = TypeVar("T")


def write_page(slab: Path, slot: int, key: str, seq: int) -> None:
    """Write ``key``'s page into ``slot`` as the backend does (header, then payload), creating
    the file if need be; nothing around it is written."""
    data = page(key, PAYLOAD)
    fd = os.open(slab, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, pack_header(key.encode(), seq, PAYLOAD, payload_checksum([data])) + data, slot * SLOT)
    finally:
        os.close(fd)


def sparse_store(root: Path, hole_bytes: int) -> dict[int, str]:
    """A slab of ``RUN`` pages at the start, ``RUN`` after a hole of ``hole_bytes`` and ``RUN``
    after another at the very end; its written slots and their keys."""
    root.mkdir(parents=True)
    gap = hole_bytes // SLOT
    middle = RUN + gap
    end = middle + RUN + gap
    written = {base + i: f"sp/{base + i}" for base in (0, middle, end) for i in range(RUN)}
    for seq, (slot, key) in enumerate(sorted(written.items()), start=1):
        write_page(slab_path(root), slot, key, seq)
    assert os.path.getsize(slab_path(root)) == (end + RUN) * SLOT
    return written


def header_reads(monkeypatch: pytest.MonkeyPatch, opener: Callable[[], T]) -> tuple[T, list[int]]:
    """``opener()`` and the offsets ``os.pread`` read meanwhile (a counting wrapper, no mock)."""
    offsets: list[int] = []
    real = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        offsets.append(offset)
        return real(fd, n, offset)

    with monkeypatch.context() as patch:
        patch.setattr(os, "pread", counting)
        return opener(), offsets


@pytest.fixture
def holey_dir(tmp_path: Path) -> Iterator[Path]:
    """A backend directory on a tmpfs mounted for the test: a filesystem that lists holes
    (``SEEK_DATA``) wherever the suite runs (CI runs as root). The filesystem of the test
    directory itself may not (the scan then reads every header: the fallback test)."""
    target = tmp_path / "tmpfs"
    target.mkdir()
    why = mount(target, "-t", "tmpfs", "-o", "size=256m", "tmpfs")
    if why is not None:
        pytest.fail(f"cannot mount a tmpfs for the sparse-slab tests (CI runs as root): {why}")
    try:
        probe = target / "hole-probe"
        fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, b"x", 1 << 20)
            assert os.lseek(fd, 0, os.SEEK_DATA) > 0, "tmpfs reported no hole"
        finally:
            os.close(fd)
            probe.unlink()
        yield target / "l3"
    finally:
        unmount(target)


def test_pages_around_large_holes_read_back_and_the_holes_are_not_read(
    holey_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: the scan read the header of all ~29,000 slots of the holes."""
    file_dir = holey_dir
    written = sparse_store(file_dir, 64 << 20)
    backend, reads = header_reads(monkeypatch, lambda: open_file(file_dir))
    with backend:
        assert {slot * SLOT for slot in written} <= set(reads), "every written header was read"
        # Around a run of written slots the block rounding of its extent may take in the next
        # slot's header (zeros, read as free), never the holes.
        assert len(reads) <= 2 * len(written), len(reads)
        keys = sorted(written.values())
        assert backend.stats().pages == len(keys)
        assert backend.get(keys) == [page(k, PAYLOAD) for k in keys]


def test_a_slab_that_is_all_hole_is_not_read_and_fills_from_its_first_slot(
    holey_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: every one of its 14,564 slot headers was read."""
    file_dir = holey_dir
    file_dir.mkdir(parents=True)
    with slab_path(file_dir).open("wb") as f:
        f.truncate(64 << 20)
    backend, reads = header_reads(monkeypatch, lambda: open_file(file_dir))
    with backend:
        assert reads == []
        assert backend.stats().pages == 0
        assert backend.set(["all/a"], [page("all/a", PAYLOAD)]) == [True]
    with slab_path(file_dir).open("rb") as f:
        parsed = parse_header(f.read(HEADER_BYTES))
    assert parsed is not None and parsed[0] == "all/a", "the lowest free slot is taken first"
    assert os.path.getsize(slab_path(file_dir)) == 64 << 20


def test_free_slots_of_a_sparse_slab_are_reused_lowest_first_after_a_restart(file_dir: Path) -> None:
    """Guards the allocation order after a scan that skipped holes, across the free runs (held
    before either fix too)."""
    written = sparse_store(file_dir, 8 << 20)
    size = os.path.getsize(slab_path(file_dir))
    fresh = [f"new/{i}" for i in range(3)]
    with open_file(file_dir) as backend:
        assert backend.delete(["sp/1"]) == 1
        assert backend.set(fresh, [page(k, PAYLOAD) for k in fresh]) == [True] * 3
    # Slot 1 (freed), then slots 4 and 5 (the first hole), and the file did not grow.
    with slab_path(file_dir).open("rb") as f:
        landed = {}
        for slot in (1, RUN, RUN + 1):
            f.seek(slot * SLOT)
            parsed = parse_header(f.read(HEADER_BYTES))
            assert parsed is not None
            landed[slot] = parsed[0]
    assert landed == {1: "new/0", RUN: "new/1", RUN + 1: "new/2"}
    assert os.path.getsize(slab_path(file_dir)) == size
    with open_file(file_dir) as backend:
        keys = sorted(set(written.values()) - {"sp/1"}) + fresh
        assert backend.get(keys) == [page(k, PAYLOAD) for k in keys]
        assert backend.exists(["sp/1"]) == 0


def test_never_written_slots_cost_no_memory_each(file_dir: Path) -> None:
    """Fails before the fix: the free list held every never-written slot as an int (~4 MB for
    the 116,000 slots of these two 256 MiB holes, 82 MB for 1 GiB of 512-byte slots)."""
    sparse_store(file_dir, 256 << 20)
    open_file(file_dir.parent / "warm").close()  # imports and first-use caches, not counted
    tracemalloc.start()
    try:
        backend = open_file(file_dir)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with backend:
        assert peak < 1 << 20, peak
        assert backend.stats().pages == 3 * RUN


@pytest.mark.parametrize("unsupported", ["EINVAL", "EOPNOTSUPP", "no SEEK_DATA"])
def test_a_filesystem_that_cannot_list_holes_gets_a_full_scan_that_finds_every_page(
    file_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, unsupported: str
) -> None:
    """Fails before the fix only on its log line: the old scan read every slot as well."""
    written = sparse_store(file_dir, 1 << 20)
    nslots = os.path.getsize(slab_path(file_dir)) // SLOT
    if unsupported == "no SEEK_DATA":
        monkeypatch.delattr(os, "SEEK_DATA")
    else:
        real = os.lseek
        code = getattr(errno, unsupported)

        def refusing(fd: int, offset: int, whence: int) -> int:
            if whence in (os.SEEK_DATA, os.SEEK_HOLE):
                raise OSError(code, os.strerror(code))
            return real(fd, offset, whence)

        monkeypatch.setattr(os, "lseek", refusing)
    with caplog.at_level(logging.DEBUG, logger="hicached.l3.file"):
        backend, reads = header_reads(monkeypatch, lambda: open_file(file_dir))
    with backend:
        assert sorted(reads) == [slot * SLOT for slot in range(nslots)]
        keys = sorted(written.values())
        assert backend.get(keys) == [page(k, PAYLOAD) for k in keys]
    fallbacks = [r.getMessage() for r in caplog.records if "SEEK_DATA" in r.getMessage()]
    assert len(fallbacks) == 1 and slab_path(file_dir).name in fallbacks[0], fallbacks
    assert all(r.levelno == logging.DEBUG for r in caplog.records if "SEEK_DATA" in r.getMessage())


def test_slots_meeting_takes_each_header_that_meets_data_once() -> None:
    slot = 4608
    assert list(slots_meeting([(4096, 8192)], slot, 10)) == [1]  # slot 0's header ends at 512
    assert list(slots_meeting([(0, slot)], slot, 10)) == [0]  # ends where slot 1 begins
    assert list(slots_meeting([(slot + HEADER_BYTES, 3 * slot)], slot, 10)) == [2]  # after slot 1's header
    assert list(slots_meeting([(slot + HEADER_BYTES - 1, slot + HEADER_BYTES)], slot, 10)) == [1]
    assert list(slots_meeting([(0, 100), (300, 600)], 512, 10)) == [0, 1]  # slot 0 meets both
    assert list(slots_meeting([(0, 100 * slot)], slot, 7)) == list(range(7))  # not past the file
    assert list(slots_meeting([], slot, 7)) == []


def test_the_free_runs_hand_out_slots_in_the_order_of_one_min_heap(tmp_path: Path) -> None:
    """Against a model of the allocator before the fix (every free slot below ``high`` in one
    min-heap): the same slot for every alloc, alloc_on_disk and release."""
    rng = random.Random(7)
    slab = Slab(tmp_path / f"slab-{SLOT}.dat", SLOT)
    try:
        high = 60
        used = set(rng.sample(range(high), 25))
        slab.restore(high, used)
        os.truncate(slab.fd, 40 * SLOT + 100)  # slots 0..39 lie wholly inside the file
        free, model_high, held = set(range(high)) - used, high, sorted(used)
        for _ in range(400):
            op = rng.choice(["alloc", "alloc", "on_disk", "release"])
            if op == "release" and held:
                slot = held.pop(rng.randrange(len(held)))
                slab.release(slot)
                free.add(slot)
            elif op == "on_disk":
                lowest = min(free, default=None)
                expect = lowest if lowest is not None and (lowest + 1) * SLOT <= 40 * SLOT + 100 else None
                assert slab.alloc_on_disk() == expect
                if expect is not None:
                    free.discard(expect)
                    held.append(expect)
            else:
                if free:
                    expect = min(free)
                    free.discard(expect)
                else:
                    expect, model_high = model_high, model_high + 1
                assert slab.alloc() == expect
                held.append(expect)
        assert slab.high == model_high
    finally:
        slab.close()
