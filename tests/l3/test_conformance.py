"""The contract every L3 backend keeps, run against each real backend."""

from __future__ import annotations

import itertools
import os
import threading

import pytest

from hicached.errors import InvalidArgument
from hicached.l3 import StorageBackend


def page(key: str, size: int = 4096) -> bytes:
    """Deterministic page content derived from the key."""
    seed = key.encode()
    return (seed * (size // len(seed) + 1))[:size]


def chunks_of(buf: bytearray, cuts: list[int]) -> list[memoryview]:
    view = memoryview(buf)
    bounds = [0, *cuts, len(buf)]
    return [view[a:b] for a, b in itertools.pairwise(bounds)]


def test_set_get_roundtrip_and_miss(backend: StorageBackend) -> None:
    keys = [f"rt/{i}" for i in range(5)]
    values = [os.urandom(4096 + i) for i in range(5)]
    assert backend.set(keys, values) == [True] * 5
    assert backend.get([*keys, "rt/missing"]) == [*values, None]


def test_exists_is_leading_run(backend: StorageBackend) -> None:
    keys = ["ex/0", "ex/1", "ex/2", "ex/3"]
    assert (
        backend.set([keys[0], keys[1], keys[3]], [page(k) for k in (keys[0], keys[1], keys[3])]) == [True] * 3
    )
    assert backend.exists(keys) == 2
    assert backend.exists(keys[3:]) == 1
    assert backend.exists(["ex/none", keys[0]]) == 0
    assert backend.exists([]) == 0


def test_present_answers_every_key_also_after_a_miss(backend: StorageBackend) -> None:
    keys = ["pr/0", "pr/1", "pr/2", "pr/3"]
    assert backend.set([keys[1], keys[3]], [page(keys[1]), page(keys[3])]) == [True, True]
    assert backend.present(keys) == [False, True, False, True]
    assert backend.present([keys[3], keys[3], "pr/none"]) == [True, True, False]
    assert backend.present([]) == []
    # The base class's default (one exists() per key) gives the same answers.
    assert StorageBackend.present(backend, keys) == [False, True, False, True]


def test_existing_key_is_success_without_rewrite(backend: StorageBackend) -> None:
    assert backend.set(["same"], [b"A" * 4096]) == [True]
    assert backend.set(["same"], [b"B" * 4096]) == [True]
    assert backend.get(["same"]) == [b"A" * 4096]


def test_duplicate_keys_in_one_batch(backend: StorageBackend) -> None:
    assert backend.set(["dup", "dup"], [b"1" * 100, b"2" * 100]) == [True, True]
    assert backend.get(["dup"]) == [b"1" * 100]
    assert backend.stats().pages == 1


def test_get_into_fills_chunks(backend: StorageBackend) -> None:
    keys = [f"gi/{i}" for i in range(6)]
    values = [os.urandom(8192) for _ in keys]
    assert all(backend.set(keys, values))
    dests = [bytearray(8192) for _ in keys]
    chunked = [chunks_of(d, [100, 4096, 5000]) for d in dests]
    assert backend.get_into(keys, chunked) == [True] * 6
    assert [bytes(d) for d in dests] == values


def test_get_into_miss_and_size_mismatch(backend: StorageBackend) -> None:
    assert all(backend.set(["gm/a"], [b"x" * 4096]))
    small, right = bytearray(100), bytearray(4096)
    result = backend.get_into(["gm/a", "gm/missing", "gm/a"], [[memoryview(small)], [], [memoryview(right)]])
    assert result == [False, False, True]
    assert bytes(right) == b"x" * 4096


def test_set_from_chunks(backend: StorageBackend) -> None:
    src = bytearray(os.urandom(12288))
    assert backend.set_from(["sf/a"], [chunks_of(src, [1, 7000])]) == [True]
    assert backend.get(["sf/a"]) == [bytes(src)]


def test_pages_of_different_sizes_and_empty(backend: StorageBackend) -> None:
    sizes = [0, 1, 511, 4096, 65536, 100_000]
    keys = [f"sz/{s}" for s in sizes]
    values = [os.urandom(s) for s in sizes]
    assert all(backend.set(keys, values))
    assert backend.get(keys) == values


def test_large_batch(backend: StorageBackend) -> None:
    keys = [f"lb/{i:04d}" for i in range(300)]
    values = [page(k, 1024) for k in keys]
    assert backend.set(keys, values) == [True] * 300
    assert backend.exists(keys) == 300
    dests = [bytearray(1024) for _ in keys]
    assert all(backend.get_into(keys, [[memoryview(d)] for d in dests]))
    assert [bytes(d) for d in dests] == values


def test_delete_counts_and_removes(backend: StorageBackend) -> None:
    keys = ["del/a", "del/b", "del/c"]
    assert all(backend.set(keys, [page(k) for k in keys]))
    assert backend.delete(["del/a", "del/c", "del/none", "del/a"]) == 2
    assert backend.get(keys) == [None, page("del/b"), None]
    assert backend.delete(["del/a"]) == 0
    assert backend.set(["del/a"], [b"new"]) == [True]
    assert backend.get(["del/a"]) == [b"new"]


def test_clear_by_prefix(backend: StorageBackend) -> None:
    keys = ["t1/a", "t1/b", "t2/a", "t1*/x"]
    assert all(backend.set(keys, [page(k) for k in keys]))
    assert backend.clear("t1*") == 1  # glob characters are literal
    assert backend.clear("t1/") == 2
    assert backend.get(keys) == [None, None, page("t2/a"), None]
    assert backend.clear() == 1
    assert backend.exists(["t2/a"]) == 0


def test_stats_count_hits_and_misses(backend: StorageBackend) -> None:
    before = backend.stats()
    assert all(backend.set(["st/a", "st/b"], [b"a" * 4096, b"b" * 4096]))
    backend.get(["st/a", "st/none"])
    backend.get_into(["st/b", "st/none2"], [[memoryview(bytearray(4096))], [memoryview(bytearray(1))]])
    after = backend.stats()
    assert after.hits - before.hits == 2
    assert after.misses - before.misses == 2
    assert after.corrupt_pages == before.corrupt_pages
    assert after.pages == before.pages + 2


def test_bad_batches_raise_and_change_nothing(backend: StorageBackend) -> None:
    with pytest.raises(InvalidArgument, match="2 keys but 1 values"):
        backend.set(["bad/a", "bad/b"], [b"x"])
    with pytest.raises(InvalidArgument, match="storage key"):
        backend.set([""], [b"x"])
    with pytest.raises(InvalidArgument, match="1 keys but 2 destinations"):
        backend.get_into(["bad/a"], [[], []])
    assert backend.exists(["bad/a"]) == 0
    assert backend.stats().pages == 0


def test_concurrent_writers_and_readers(backend: StorageBackend) -> None:
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            keys = [f"cc/{t}/{i}" for i in range(40)]
            values = [page(k, 2048) for k in keys]
            for start in range(0, 40, 8):
                assert all(backend.set(keys[start : start + 8], values[start : start + 8]))
                assert backend.get(keys[: start + 8]) == values[: start + 8]
            assert backend.exists(keys) == 40
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert backend.stats().pages == 160


def test_many_chunks_and_mixed_sizes(backend: StorageBackend) -> None:
    sizes = [12000, 4096, 100, 12000, 65536]
    keys = [f"mc/{i}" for i in range(len(sizes))]
    srcs = [bytearray(os.urandom(n)) for n in sizes]
    # Page 0 arrives in 1500 chunks: more than one vectored syscall can take.
    src_chunks = [chunks_of(srcs[0], list(range(8, 12000, 8)))] + [[memoryview(b)] for b in srcs[1:]]
    assert backend.set_from(keys, src_chunks) == [True] * len(keys)
    dests = [bytearray(n) for n in sizes]
    dest_chunks = [[memoryview(d)] for d in dests]
    dest_chunks[3] = chunks_of(dests[3], list(range(8, 12000, 8)))
    assert backend.get_into(keys, dest_chunks) == [True] * len(keys)
    assert dests == srcs
