"""The ``file`` backend: crash atomicity, verification, index rebuild, LRU capacity."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hicached.errors import FailedPrecondition, InvalidArgument, Unavailable
from hicached.l3 import create_backend
from hicached.l3.file import HEADER_BYTES, MAX_KEY_BYTES, FileBackend, slot_bytes_for
from hicached.l3.file.layout import pack_header, parse_header

SLOT = slot_bytes_for(4096)


def page(key: str, size: int = 4096) -> bytes:
    seed = key.encode()
    return (seed * (size // len(seed) + 1))[:size]


def open_file(path: Path, capacity: int = 64 << 20, **extra: object) -> FileBackend:
    backend = create_backend("file", {"path": str(path), "capacity_bytes": capacity, **extra})
    assert isinstance(backend, FileBackend)
    return backend


def slab_path(path: Path, payload: int = 4096) -> Path:
    return path / f"slab-{slot_bytes_for(payload)}.dat"


def flip_byte(file: Path, offset: int) -> None:
    with file.open("r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0xFF]))


def test_index_rebuilt_after_reopen(file_dir: Path) -> None:
    keys = [f"rb/{i}" for i in range(10)]
    with open_file(file_dir) as backend:
        assert all(backend.set(keys, [page(k, 4096 + 100 * i) for i, k in enumerate(keys)]))
        assert backend.delete(["rb/3"]) == 1
    with open_file(file_dir) as backend:
        stats = backend.stats()
        assert stats.pages == 9
        assert stats.bytes == sum(4096 + 100 * i for i in range(10) if i != 3)
        assert backend.exists(keys[:3]) == 3
        assert backend.get(["rb/3"]) == [None]
        assert backend.get(keys[4:]) == [page(k, 4096 + 100 * i) for i, k in enumerate(keys) if i >= 4]


def test_corrupt_payload_is_a_counted_miss(file_dir: Path) -> None:
    with open_file(file_dir) as backend:
        assert all(backend.set(["c/a", "c/b"], [page("c/a"), page("c/b")]))
        flip_byte(slab_path(file_dir), HEADER_BYTES + 1234)  # slot 0 payload
        dest = bytearray(4096)
        assert backend.get_into(["c/a"], [[memoryview(dest)]]) == [False]
        assert backend.get(["c/a", "c/b"]) == [None, page("c/b")]
        stats = backend.stats()
        assert stats.corrupt_pages == 1
        assert stats.misses == 2
        assert backend.exists(["c/a"]) == 0
        assert backend.set(["c/a"], [page("c/a")]) == [True]
        assert backend.get(["c/a"]) == [page("c/a")]


def test_corrupt_header_is_dropped_at_start(file_dir: Path) -> None:
    with open_file(file_dir) as backend:
        assert all(backend.set(["h/a", "h/b"], [page("h/a"), page("h/b")]))
    flip_byte(slab_path(file_dir), 20)  # slot 0 header (sequence number)
    with open_file(file_dir) as backend:
        assert backend.exists(["h/a"]) == 0
        assert backend.get(["h/b"]) == [page("h/b")]


def test_a_header_with_the_last_sequence_number_is_dropped_and_writes_go_on(file_dir: Path) -> None:
    """A header that verifies but carries a sequence number the next write cannot follow (another
    program's, or a damaged store's). Before, it was indexed and every later write of the backend
    raised struct.error packing its header, for good."""
    with open_file(file_dir) as backend:
        assert backend.set(["q/a", "q/b"], [page("q/a"), page("q/b")]) == [True, True]
    with slab_path(file_dir).open("r+b") as f:
        parsed = parse_header(f.read(HEADER_BYTES))
        assert parsed is not None and parsed[0] == "q/a"
        f.seek(0)
        f.write(pack_header(b"q/a", (1 << 64) - 1, parsed[2], parsed[3]))
    with open_file(file_dir) as backend:
        assert backend.exists(["q/a"]) == 0
        assert backend.stats().corrupt_pages == 1
        assert backend.get(["q/b"]) == [page("q/b")]
        assert backend.set(["q/c", "q/a"], [page("q/c"), page("q/a")]) == [True, True]
    with open_file(file_dir) as backend:
        assert backend.get(["q/a", "q/b", "q/c"]) == [page("q/a"), page("q/b"), page("q/c")]


def test_torn_write_is_never_served(file_dir: Path) -> None:
    with open_file(file_dir) as backend:
        assert backend.set(["torn"], [page("torn")]) == [True]
    # What a kill mid-pwrite leaves: a whole header, a payload half old, half new.
    with slab_path(file_dir).open("r+b") as f:
        f.seek(HEADER_BYTES + 2048)
        f.write(b"\0" * 2048)
    with open_file(file_dir) as backend:
        assert backend.exists(["torn"]) == 1  # headers alone are trusted at start
        assert backend.get(["torn"]) == [None]
        assert backend.stats().corrupt_pages == 1
    with open_file(file_dir) as backend:
        assert backend.exists(["torn"]) == 0  # its header was cleared


def test_a_torn_page_found_at_start_is_written_again_by_set(file_dir: Path) -> None:
    """Fails before (a review that killed writers): a page indexed at start from its header
    alone counted as stored, so set() answered True and wrote nothing, and the page was lost
    for good once it left L2 (the daemon's write-through trusts that answer). Now set() reads
    back a page found at start first: a whole one stands, a torn one is written again."""
    with open_file(file_dir) as backend:
        assert backend.set(["tw/a", "tw/b"], [page("tw/a"), page("tw/b")]) == [True, True]
    with slab_path(file_dir).open("r+b") as f:  # slot 0 (tw/a): a kill mid-pwrite
        f.seek(HEADER_BYTES + 2048)
        f.write(b"\0" * 2048)
    with open_file(file_dir) as backend:
        assert backend.set(["tw/a", "tw/b"], [page("tw/a"), page("tw/b")]) == [True, True]
        assert backend.stats().corrupt_pages == 1  # tw/a, found torn by the read back
        assert (backend.stats().hits, backend.stats().misses) == (0, 0)  # nobody asked for them
        assert backend.get(["tw/a", "tw/b"]) == [page("tw/a"), page("tw/b")]
        assert backend.set(["tw/b"], [page("tw/a")]) == [True]  # read back whole: the first copy stands
        assert backend.get(["tw/b"]) == [page("tw/b")]
    with open_file(file_dir) as backend:  # the new copy stands, the torn one is gone
        assert backend.get(["tw/a", "tw/b"]) == [page("tw/a"), page("tw/b")]
        assert backend.stats().pages == 2


def test_truncated_slab_is_a_miss(file_dir: Path) -> None:
    with open_file(file_dir) as backend:
        assert all(backend.set(["tr/a", "tr/b"], [page("tr/a"), page("tr/b")]))
    # What a full disk leaves: the last slot's header written, its payload cut short.
    os.truncate(slab_path(file_dir), SLOT + HEADER_BYTES + 10)
    with open_file(file_dir) as backend:
        assert backend.exists(["tr/b"]) == 0  # not indexed: its payload is not in the file
        assert backend.stats().corrupt_pages == 1
        assert backend.get(["tr/a", "tr/b"]) == [page("tr/a"), None]
        dest = bytearray(4096)
        assert backend.get_into(["tr/b"], [[memoryview(dest)]]) == [False]


def test_files_named_like_slabs_that_it_does_not_write_are_ignored_at_start(file_dir: Path) -> None:
    with open_file(file_dir) as backend:
        assert backend.set(["s/a"], [page("s/a")]) == [True]
    (file_dir / "slab-0.dat").touch()
    (file_dir / "slab-100.dat").touch()
    (file_dir / "slab-1024.dat").mkdir()
    with open_file(file_dir) as backend:
        assert backend.get(["s/a"]) == [page("s/a")]
        assert backend.set(["s/b"], [page("s/b")]) == [True]
        # The name of 100-byte pages' slab is taken by the directory: not stored, and the
        # backend still closes (the failed open ended its operation).
        assert backend.set(["s/c"], [page("s/c", 100)]) == [False]


def test_a_destination_of_another_size_is_a_miss_that_keeps_the_page(file_dir: Path) -> None:
    with open_file(file_dir) as backend:
        assert backend.set(["d/a"], [page("d/a")]) == [True]
        short = bytearray(4095)
        assert backend.get_into(["d/a"], [[memoryview(short)]]) == [False]
        assert backend.exists(["d/a"]) == 1
        assert backend.stats().corrupt_pages == 0
        assert backend.get(["d/a"]) == [page("d/a")]


def test_lru_eviction_at_capacity(file_dir: Path) -> None:
    with open_file(file_dir, capacity=4 * SLOT) as backend:
        keys = ["l/a", "l/b", "l/c", "l/d"]
        assert all(backend.set(keys, [page(k) for k in keys]))
        assert backend.get(["l/a"]) == [page("l/a")]  # a is now the most recent
        assert backend.set(["l/e"], [page("l/e")]) == [True]
        assert backend.exists(["l/b"]) == 0
        assert backend.exists(["l/a", "l/c", "l/d", "l/e"]) == 4
        stats = backend.stats()
        assert (stats.pages, stats.evicted_pages) == (4, 1)
        assert os.path.getsize(slab_path(file_dir)) <= 4 * SLOT
        # A page bigger than the whole capacity is refused, nothing evicted.
        assert backend.set(["l/huge"], [b"x" * (4 * SLOT)]) == [False]
        assert backend.stats().evicted_pages == 1
    # Write order survives a restart: the oldest write goes first.
    with open_file(file_dir, capacity=4 * SLOT) as backend:
        assert backend.set(["l/f"], [page("l/f")]) == [True]
        assert backend.exists(["l/a"]) == 0
        assert backend.exists(["l/c", "l/d", "l/e", "l/f"]) == 4
    with open_file(file_dir, capacity=2 * SLOT) as backend:  # smaller limit: trimmed at start
        assert backend.stats().pages == 2
        assert backend.exists(["l/e", "l/f"]) == 2


def test_slots_are_freed_exactly_once(file_dir: Path) -> None:
    with open_file(file_dir, capacity=8 * SLOT) as backend:
        for round_ in range(5):
            keys = [f"f/{round_}/{i}" for i in range(8)]
            assert backend.set(keys, [page(k) for k in keys]) == [True] * 8
            assert backend.delete(keys) == 8
            assert backend.stats().pages == 0
        assert backend.stats().evicted_pages == 0
        assert os.path.getsize(slab_path(file_dir)) <= 8 * SLOT
        # Full capacity is usable again and one more page needs exactly one eviction.
        keys = [f"f/last/{i}" for i in range(9)]
        assert backend.set(keys[:8], [page(k) for k in keys[:8]]) == [True] * 8
        assert backend.stats().evicted_pages == 0
        assert backend.set(keys[8:], [page(keys[8])]) == [True]
        assert backend.stats().evicted_pages == 1
        # Pages of one batch cannot evict each other: a batch over capacity fails its tail.
        big = [f"f/big/{i}" for i in range(9)]
        assert backend.set(big, [page(k) for k in big]) == [True] * 8 + [False]


def test_reads_pin_slots_against_reuse(file_dir: Path) -> None:
    """Deleting and rewriting while readers run never serves another page's bytes."""
    with open_file(file_dir, capacity=16 * SLOT) as backend:
        keys = [f"p/{i}" for i in range(8)]
        assert all(backend.set(keys, [page(k) for k in keys]))
        stop = threading.Event()
        wrong: list[str] = []

        def reader() -> None:
            while not stop.is_set():
                for key, got in zip(keys, backend.get(keys), strict=True):
                    if got is not None and got != page(key):
                        wrong.append(key)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for round_ in range(200):
                victim = keys[round_ % 8]
                backend.delete([victim])
                assert backend.set([f"other/{round_}"], [page(f"other/{round_}")]) == [True]
                assert backend.set([victim], [page(victim)]) == [True]
                backend.delete([f"other/{round_}"])
        finally:
            stop.set()
            thread.join()
        assert wrong == []
        assert backend.stats().corrupt_pages == 0


def test_one_process_per_directory(file_dir: Path) -> None:
    backend = open_file(file_dir)
    with pytest.raises(FailedPrecondition, match="in use"):
        open_file(file_dir)
    backend.close()
    open_file(file_dir).close()


def test_closed_backend_is_unavailable(file_dir: Path) -> None:
    backend = open_file(file_dir)
    backend.close()
    backend.close()
    with pytest.raises(Unavailable, match="closed"):
        backend.get(["x"])
    with pytest.raises(Unavailable, match="closed"):
        backend.set(["x"], [b"x"])


def test_key_too_long_changes_nothing(file_dir: Path) -> None:
    with open_file(file_dir) as backend:
        long_key = "k" * (MAX_KEY_BYTES + 1)
        with pytest.raises(InvalidArgument, match=f"max {MAX_KEY_BYTES}"):
            backend.set(["ok", long_key], [b"1", b"2"])
        assert backend.stats().pages == 0
        assert backend.set(["k" * MAX_KEY_BYTES], [b"1"]) == [True]
        with pytest.raises(InvalidArgument, match="bytes-like, got str"):
            backend.set(["s"], ["text"])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="read-only"):
            backend.get_into(["s"], [[memoryview(b"x")]])


def test_fsync_option_and_bad_config(file_dir: Path) -> None:
    with open_file(file_dir, fsync=True) as backend:
        assert backend.set(["fs"], [b"durable"]) == [True]
        backend.sync()
    with pytest.raises(InvalidArgument, match="capacity_bytes"):
        open_file(file_dir, capacity=10)


CRASH_PAGE = 1 << 20
CRASH_BATCH = 8


def crash_page(key: str, i: int) -> tuple[bytes, bytes]:
    """Page ``i`` of a batch: the key (padded to 64 bytes), then a fixed random body."""
    return key.encode().ljust(64, b"."), random.Random(i).randbytes(CRASH_PAGE - 64 * (i + 1))


# The child builds its page bodies once and sends pages as (key, body) chunks,
# so nearly all of its time is spent inside the write: a kill lands mid-write.
CHILD = textwrap.dedent(
    f"""
    import random, sys
    from hicached.l3 import create_backend

    bodies = [random.Random(i).randbytes({CRASH_PAGE} - 64 * (i + 1)) for i in range({CRASH_BATCH})]
    backend = create_backend("file", {{"path": sys.argv[1], "capacity_bytes": 1 << 34}})
    batch = 0
    while True:
        keys = [f"crash/{{batch}}/{{i}}" for i in range({CRASH_BATCH})]
        srcs = [[memoryview(k.encode().ljust(64, b".")), memoryview(bodies[i])] for i, k in enumerate(keys)]
        if not all(backend.set_from(keys, srcs)):
            sys.exit(3)
        sys.stdout.write(f"{{batch}}\\n")
        sys.stdout.flush()
        batch += 1
    """
)


def test_sigkill_mid_write_loses_nothing_acknowledged(file_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(file_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    acked = -1
    try:
        while acked < 24:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else "child died"
            acked = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        # Batches acknowledged after our last read still count as acknowledged.
        for line in proc.stdout:
            acked = int(line)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with open_file(file_dir, capacity=1 << 34) as backend:
        for batch in range(acked + 3):
            keys = [f"crash/{batch}/{i}" for i in range(CRASH_BATCH)]
            got = backend.get(keys)
            for i, (key, data) in enumerate(zip(keys, got, strict=True)):
                expected = b"".join(crash_page(key, i))
                if batch <= acked:
                    assert data == expected, f"acknowledged page {key} lost or wrong"
                else:
                    assert data is None or data == expected, f"partial page {key} served"


@pytest.mark.parametrize("io_threads", [1, 4])
def test_scattered_batches_on_io_threads(file_dir: Path, io_threads: int) -> None:
    keys = [f"sc/{i}" for i in range(64)]
    with open_file(file_dir, io_threads=io_threads) as backend:
        for start in range(0, 64, 8):  # separate batches, then deletions: scattered slots
            assert all(backend.set(keys[start : start + 8], [page(k) for k in keys[start : start + 8]]))
        assert backend.delete(keys[::3]) == 22
        order = [k for k in random.Random(7).sample(keys, len(keys))]
        dests = [bytearray(4096) for _ in order]
        ok = backend.get_into(order, [[memoryview(d)] for d in dests])
        assert ok == [k not in keys[::3] for k in order]
        assert all(bytes(d) == page(k) for k, d, good in zip(order, dests, ok, strict=True) if good)
        got = backend.get(order)
        assert got == [page(k) if k not in keys[::3] else None for k in order]
        refill = [f"sc/new/{i}" for i in range(22)]  # lands in the freed, scattered slots
        assert all(backend.set(refill, [page(k) for k in refill]))
        assert backend.get(refill) == [page(k) for k in refill]
    assert not [t for t in threading.enumerate() if t.name.startswith("hicached-l3-file")]
    with pytest.raises(InvalidArgument, match="io_threads"):
        open_file(file_dir, io_threads=0)


@pytest.mark.parametrize("io_threads", [1, 4])
def test_a_read_batch_split_across_threads_is_byte_exact_and_verified(
    file_dir: Path, io_threads: int
) -> None:
    """A get_into batch larger than one read split (1 MiB) is read as several runs on the I/O
    threads: every page lands byte-exact in its own destination, and a corrupt page in a middle
    run is a counted miss that leaves its neighbours served."""
    size = 64 << 10
    keys = [f"split/{i}" for i in range(48)]  # 48 x 64.5 KiB slots: three 1 MiB runs and a bit
    with open_file(file_dir, io_threads=io_threads) as backend:
        assert all(backend.set(keys, [page(k, size) for k in keys]))
        flip_byte(slab_path(file_dir, size), 30 * slot_bytes_for(size) + HEADER_BYTES + 7)
        dests = [bytearray(size) for _ in keys]
        ok = backend.get_into(keys, [[memoryview(d)] for d in dests])
        assert ok == [i != 30 for i in range(len(keys))]
        assert all(
            bytes(d) == page(k, size) for i, (d, k) in enumerate(zip(dests, keys, strict=True)) if i != 30
        )
        assert backend.stats().corrupt_pages == 1


def test_slab_files_together_stay_within_the_capacity(file_dir: Path) -> None:
    """Before: the capacity counted occupied slots only and a slab file never shrank, so pages
    of one new size after another (a client's pool shape is its own choice) grew the directory
    by up to the capacity per size (a reviewer's 12 sizes: 95.6 MiB on disk at 8 MiB)."""
    capacity = 64 * SLOT
    sizes = [4096 * n - 100 for n in range(1, 7)]
    with open_file(file_dir, capacity=capacity) as backend:
        for size in sizes:
            keys = [f"d/{size}/{i}" for i in range(capacity // slot_bytes_for(size))]
            stored = backend.set(keys, [page(k, size) for k in keys])
            on_disk = sum(os.path.getsize(p) for p in file_dir.glob("slab-*.dat"))
            assert on_disk <= capacity, (size, on_disk)
            assert sum(stored) >= len(keys) - 1, (size, sum(stored), len(keys))
        # the newest size is whole and byte-exact; the older ones were evicted to make room
        assert backend.get(keys[-4:]) == [page(k, sizes[-1]) for k in keys[-4:]]
        assert backend.exists([f"d/{sizes[0]}/0"]) == 0
    with open_file(file_dir, capacity=capacity) as backend:  # what was stored survives a restart
        assert backend.exists(keys[-4:]) == 4


def test_pages_beyond_max_pages_evict_the_oldest_whatever_their_size(file_dir: Path) -> None:
    """Fails before (a review of stop 47): only bytes bounded the store, so a client's pages of a
    few bytes (a 1 KiB slot each) grew the in-memory index by capacity / 1 KiB keys (16.8 M at
    the defaults: GiBs of daemon memory, none of it in any budget)."""
    keys = [f"tiny/{i}" for i in range(20)]
    with open_file(file_dir, max_pages=8) as backend:
        for lo in range(0, 20, 5):  # batches: the count holds across them and within one
            assert backend.set(keys[lo : lo + 5], [k.encode() for k in keys[lo : lo + 5]]) == [True] * 5
        stats = backend.stats()
        assert (stats.pages, stats.evicted_pages) == (8, 12)
        assert backend.exists(keys[12:]) == 8 and backend.exists(keys[:12]) == 0
        assert backend.get(keys[12:]) == [k.encode() for k in keys[12:]]
    with open_file(file_dir, max_pages=3) as backend:  # a lower bound: trimmed at start, oldest first
        assert backend.stats().pages == 3
        assert backend.exists(keys[17:]) == 3 and backend.exists(keys[12:17]) == 0
    with open_file(file_dir, max_pages=3) as backend:  # the trimmed pages do not come back
        assert backend.stats().pages == 3
    with pytest.raises(InvalidArgument, match="max_pages"):
        open_file(file_dir, max_pages=0)
