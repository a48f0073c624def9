"""The file L3 backend under disk faults: a disk that fills before ``l3.capacity`` is treated as
full (LRU eviction, lowered capacity) instead of stopping backups for good; a key longer than the
backend can store is refused at the front; a slot header damaged on disk is counted in
``corrupt_pages`` when the start-up scan drops it.

Real files on a real small filesystem (a tmpfs the test mounts; a loop-mounted file when mount
of tmpfs is refused), a real daemon subprocess for the key-length refusal.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hicached_client import HiCacheClient, PageBytes, WorkerIdentity
from hicached_client.errors import HiCacheError

from hicached.l3.file import HEADER_BYTES, MAX_KEY_BYTES, FileBackend, FileBackendConfig, slot_bytes_for
from hicached.l3.file import index as file_index
from tests.support.daemon import start_daemon
from tests.support.kv import POOLS, WorkerPools, transfers, unique_tag
from tests.support.mounts import mount, unmount

PAGE = 64 << 10
KEY_OFFSET = 44  # magic..checksum (36 bytes) and the header's own checksum (8) precede the key
assert KEY_OFFSET < HEADER_BYTES
DISK = "2m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB filesystem mounted at a fresh directory (unmounted afterwards)."""
    target = tmp_path / "disk"
    target.mkdir()
    why = mount(target, "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs")
    if why is not None:
        image = tmp_path / "disk.img"
        with image.open("wb") as f:
            f.truncate(4 << 20)
        mkfs = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, check=False)
        loop_why = mount(target, "-o", "loop", str(image)) if mkfs.returncode == 0 else "mkfs.ext4 failed"
        if loop_why is not None:
            pytest.fail(f"cannot mount a small filesystem (tmpfs: {why}; loop file: {loop_why})")
    try:
        yield target
    finally:
        unmount(target)


def page(i: int) -> bytes:
    return i.to_bytes(4, "little") * (PAGE // 4)


def test_disk_full_before_capacity_evicts_and_keeps_backing_up(small_disk: Path) -> None:
    """Fails before the fix: once the disk was full, every write failed with ENOSPC for good (the
    configured 64 MiB capacity was never reached, so LRU eviction never made room)."""
    backend = FileBackend(FileBackendConfig(path=str(small_disk / "l3"), capacity_bytes=64 << 20))
    try:
        fits = (2 << 20) // slot_bytes_for(PAGE)
        total = 4 * fits
        results = [backend.set([f"k{i}", f"k{i}b"], [page(i), page(i + 10_000)]) for i in range(total)]
        assert all(r == [True, True] for r in results), [
            i for i, r in enumerate(results) if r != [True, True]
        ]
        stats = backend.stats()
        assert stats.evicted_pages > 0
        assert stats.capacity_bytes <= 2 << 20, "the effective capacity is lowered to what the disk holds"
        assert backend.get([f"k{total - 1}", f"k{total - 1}b"]) == [page(total - 1), page(total - 1 + 10_000)]
        assert backend.exists(["k0"]) == 0, "the oldest pages made room"
    finally:
        backend.close()


def test_the_capacity_comes_back_once_the_disk_has_room_again(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before (a review of stop 46): a moment of full disk lowered the capacity for as
    long as the daemon ran; with the other file gone, the backend still kept a few pages and
    evicted the rest (a review's 24 MiB L3 kept 2 MiB). Now it looks at the filesystem's room
    again (here at every page: the interval is a second) and raises the capacity back."""
    monkeypatch.setattr(file_index, "REGROW_INTERVAL_S", 0.0)
    filler = small_disk / "other-file"
    filler.write_bytes(bytes(3 << 19))  # 1.5 MiB of the 2 MiB: another program's file
    backend = FileBackend(FileBackendConfig(path=str(small_disk / "l3"), capacity_bytes=64 << 20))
    try:
        for i in range(16):
            assert backend.set([f"k{i}"], [page(i)]) == [True], i
        lowered = backend.stats().capacity_bytes
        assert lowered <= (1 << 19) + slot_bytes_for(PAGE), "the disk filled: the capacity is lowered"
        filler.unlink()
        fresh = [f"n{i}" for i in range(20)]  # more pages than the lowered capacity holds
        for i, key in enumerate(fresh):
            assert backend.set([key], [page(100 + i)]) == [True], key
        assert backend.stats().capacity_bytes > lowered + 12 * slot_bytes_for(PAGE)
        assert backend.exists(fresh) == len(fresh), "none of them was evicted"
        assert backend.get(fresh[:1]) == [page(100)]
    finally:
        backend.close()


def test_a_disk_full_before_the_first_page_does_not_stop_that_page_size_for_good(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before (a review of stop 46): a disk full before any page lowered the capacity
    to 512 bytes, and a page of a larger slot was refused before the capacity could be
    raised back, also once the disk had room again."""
    monkeypatch.setattr(file_index, "REGROW_INTERVAL_S", 0.0)
    filler = small_disk / "other-file"
    backend = FileBackend(FileBackendConfig(path=str(small_disk / "l3"), capacity_bytes=64 << 20))
    try:
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        filler.write_bytes(bytes(free - slot_bytes_for(PAGE) // 2))  # less than one slot left
        assert backend.set(["k0"], [page(0)]) == [False]
        assert backend.stats().capacity_bytes < slot_bytes_for(PAGE)
        filler.unlink()
        assert backend.set(["k1", "k2"], [page(1), page(2)]) == [True, True]
        assert backend.get(["k1", "k2"]) == [page(1), page(2)]
    finally:
        backend.close()


def test_daemon_keeps_backing_up_when_the_l3_disk_fills_before_its_capacity(small_disk: Path) -> None:
    """Fails before the fix: with ``l3.capacity`` (16 GiB) far above the 2 MiB disk, backups
    stopped for good once the disk was full (every later page a failed backup, LRU never ran)."""
    daemon = start_daemon("--l3", "file", "--l3-path", str(small_disk / "l3"))
    pools = WorkerPools.create(unique_tag("fulldisk"))
    batch = 256  # about 2.5 KiB of slots per key: the disk holds ~800 keys, 8 rounds need 2,048
    try:
        with HiCacheClient(daemon.target, timeout_s=60.0) as client:
            ident = WorkerIdentity(unique_tag("w"), generation=1, model_name="m-fulldisk")
            session = client.attach(ident, pools.specs(), heartbeat=True)
            for r in range(8):
                keys = [f"r{r}-k{i}" for i in range(batch)]
                assert session.put_pages(keys, transfers(range(batch))).ok
                backed = session.backup(keys, wait=True)
                assert backed.stored_pages == backed.queued_pages, (r, backed, daemon.log)
                assert session.lookup(keys).total_hit_pages == batch
            (l3,) = client.get_stats().backends
            assert l3.capacity_bytes <= 2 << 20, "the disk's real size became the capacity"
            assert 0 < l3.pages < 8 * batch * 2, "old pages were evicted to make room"
            session.detach()
        assert daemon.log.count(" WARNING ") <= 3, daemon.log  # not one warning per page
    finally:
        daemon.stop()
        pools.close()


def test_a_key_too_long_for_the_file_backend_is_refused_up_front(tmp_path: Path) -> None:
    """Fails before the fix: the put was acknowledged and the key then failed in the backup
    thread with an InvalidArgument traceback on every attempt."""
    daemon = start_daemon("--l3", "file", "--l3-path", str(tmp_path / "l3"))
    pools = WorkerPools.create(unique_tag("longkey"))
    try:
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            ident = WorkerIdentity(unique_tag("w"), generation=1, model_name="m-longkey")
            session = client.attach(ident, pools.specs(), heartbeat=False)
            long_key = "k" * MAX_KEY_BYTES
            page_bytes = {p.name: p.page_bytes for p in session.info.pools}
            before = session.stats().free_pages()  # its own group (a worker sees no other)
            with pytest.raises(HiCacheError) as refused:
                session.put_pages([long_key], transfers([0]))
            assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {MAX_KEY_BYTES} bytes" in refused.value.message, refused.value.message
            assert len(refused.value.message) < 400, "the message quotes only a prefix of the key"
            assert session.lookup([long_key]).total_hit_pages == 0, "a refused put changes nothing"
            with pytest.raises(HiCacheError) as by_bytes:
                session.put_bytes([PageBytes(long_key, name, bytes(page_bytes[name])) for name in POOLS])
            assert by_bytes.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {MAX_KEY_BYTES} bytes" in by_bytes.value.message
            assert session.stats().free_pages() == before, "no host page was taken"
            short = session.put_pages(["short-key"], transfers([1]))
            assert short.ok
            backed = session.backup(["short-key"], wait=True)
            assert backed.stored_pages == backed.queued_pages
            session.detach()
        assert "Traceback" not in daemon.log, daemon.log
    finally:
        daemon.stop()
        pools.close()


def test_header_corruption_found_at_start_is_counted(tmp_path: Path) -> None:
    """Fails before the fix: the start-up scan dropped a page whose slot header failed
    verification without counting it in ``corrupt_pages``."""
    root = tmp_path / f"l3-{uuid.uuid4().hex[:6]}"
    backend = FileBackend(FileBackendConfig(path=str(root)))
    assert backend.set([f"k{i}" for i in range(4)], [page(i) for i in range(4)]) == [True] * 4
    backend.close()
    (slab,) = root.glob("slab-*.dat")
    with slab.open("r+b") as f:  # flip the first byte of page 2's key (after 36 + 8 fixed bytes)
        offset = 2 * slot_bytes_for(PAGE) + KEY_OFFSET
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    backend = FileBackend(FileBackendConfig(path=str(root)))
    try:
        stats = backend.stats()
        assert (stats.pages, stats.corrupt_pages) == (3, 1)
        assert backend.get(["k2"]) == [None]
    finally:
        backend.close()
    backend = FileBackend(FileBackendConfig(path=str(root)))
    try:
        assert (backend.stats().pages, backend.stats().corrupt_pages) == (3, 0), "counted once, then cleared"
    finally:
        backend.close()
