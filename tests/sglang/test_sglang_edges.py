"""The corners of SGLang's storage interface, against HiCacheFile where it has an answer:
a tenant, a clear before any pool, a key repeated in one batch, malformed arguments, calls
after close, a by-key tensor that lost a chunk to eviction, and a session replaced while
another thread writes. HiCachedStorage never raises into SGLang's threads."""

from __future__ import annotations

import logging
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hicached_client import HiCacheClient, PageBytes
from hicached_client.sglang import HiCachedStorage
from hicached_client.sglang.refusals import DEFAULT_INTERVAL_S
from sglang.srt.mem_cache.hicache_storage import PoolTransfer

from tests.sglang.pools import PoolShape, StorageFactory, make_host_pool, sglang_keys, unique_model
from tests.sglang.test_sglang_hicachefile_parity import generic_calls, ours, reference, run_both
from tests.support.daemon import start_daemon
from tests.support.state import poll

Backend = Any


def test_the_generic_api_with_a_tenant_matches_hicachefile(
    storages: StorageFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="hicached_client.sglang"):
        run_both(reference(storages, tmp_path, None), ours(storages, None, tenant="team-a"), generic_calls)
    assert "PERMISSION_DENIED" not in caplog.text


def test_clear_before_any_pool_matches_hicachefile(storages: StorageFactory, tmp_path: Path) -> None:
    def calls(backend: Backend) -> list[object]:
        return [
            backend.set("a", torch.arange(4.0)),
            backend.clear(),
            backend.exists("a"),
            backend.set("a", torch.zeros(4)),
            backend.get("a", torch.empty(4)),
        ]

    run_both(reference(storages, tmp_path, None), ours(storages, None), calls)


def test_keys_with_a_tilde_are_stored_like_hicachefile(storages: StorageFactory, tmp_path: Path) -> None:
    """Fails before the fix (a review against HiCacheFile): the daemon refuses '~' in a key
    (its tenant separator), so a set of such a key failed, and one in a page batch failed the
    whole batch: every other key of it was not stored, or read as a miss."""
    pool = make_host_pool(PoolShape())
    src, dst = pool.alloc(12), pool.alloc(12)
    keys = [*sglang_keys(1, 4, first=95_000), "p~q", *sglang_keys(1, 4, first=96_000)]

    def calls(backend: Backend) -> list[object]:
        return [
            backend.set("a~b", torch.arange(4.0)),
            backend.get("a~b", torch.empty(4)),
            backend.batch_set_v2([PoolTransfer(name="kv", keys=keys, host_indices=src)]),
            backend.batch_exists(keys),
            backend.batch_get_v2([PoolTransfer(name="kv", keys=keys, host_indices=dst)]),
        ]

    got = run_both(reference(storages, tmp_path, pool), ours(storages, pool), calls)
    assert got[0] is True and got[2] == {"kv": [True] * 3} and got[3] == 3, got


def test_a_key_repeated_in_one_batch_is_stored_like_hicachefile(
    storages: StorageFactory, tmp_path: Path
) -> None:
    pool = make_host_pool(PoolShape())
    keys = sglang_keys(3, 4)
    src = pool.alloc(16)

    def calls(backend: Backend) -> list[object]:
        repeated = [keys[0], keys[1], keys[0], keys[2]]
        flat = pool.get_data_page(int(src[0]), flat=True).clone()
        return [
            backend.batch_set_v2([PoolTransfer(name="kv", keys=repeated, host_indices=src)]),
            backend.batch_exists(keys),
            backend.batch_set(["f", "g", "f"], [flat, flat, flat]),
            backend.batch_exists(["f", "g"]),
        ]

    got = run_both(reference(storages, tmp_path, pool), ours(storages, pool), calls)
    assert got[0] == {"kv": [True] * 4} and got[1] == 3


def test_malformed_calls_answer_like_hicachefile(storages: StorageFactory, tmp_path: Path) -> None:
    pool = make_host_pool(PoolShape())
    keys = sglang_keys(2, 4)
    src = pool.alloc(8)

    def calls(backend: Backend) -> list[object]:
        return [
            backend.batch_set(["m1", "m2"], [torch.arange(3.0)]),  # fewer values than keys
            backend.batch_get(["m1", "m2"], [torch.empty(3)]),  # fewer targets than keys
            backend.set("", torch.arange(5.0)),  # an empty key
            backend.exists(""),
            backend.get("", torch.empty(5)),
            backend.batch_get_v2(
                [PoolTransfer(name="kv", keys=keys[:1], host_indices=src[1:5])]
            ),  # misaligned
        ]

    run_both(reference(storages, tmp_path, pool), ours(storages, pool), calls)


def test_more_targets_than_keys_and_keys_that_cannot_be_sent_answer_like_hicachefile(
    storages: StorageFactory, tmp_path: Path
) -> None:
    """Fails before (a review of stop 46): a batch_get of one key into two page targets lost
    the key (an IndexError read as a miss), and a key with a lone surrogate made batch_exists
    answer 0 for the run before it (its UnicodeEncodeError escaped the per-key check)."""
    pool = make_host_pool(PoolShape())
    src = pool.alloc(8)
    key = sglang_keys(1, 4, first=70_000)

    def calls(backend: Backend) -> list[object]:
        flat = pool.get_data_page(int(src[0]), flat=True).clone()
        return [
            backend.batch_set(key, [flat]),
            backend.batch_get(key, [torch.empty_like(flat), torch.empty_like(flat)]),
            backend.batch_exists([key[0], "\ud800", "x"]),
        ]

    got = run_both(reference(storages, tmp_path, pool), ours(storages, pool), calls)
    assert got[0] is True and got[2] == 1, got


def test_a_daemon_that_is_down_is_reported_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """Fails before (a review of stop 46): with the daemon down, every call logged a warning
    of its own (90 calls: 120 lines). Failures are reported as refusals are: the first, then
    at most one line per interval with the count folded in."""
    d = start_daemon("--l3", "none")
    factory = StorageFactory(d.target)
    try:
        pool = make_host_pool(PoolShape())
        storage = factory.make(pool, model=unique_model())
        keys = sglang_keys(4, 4, first=80_000)
        src, dst = pool.alloc(16), pool.alloc(16)
        assert storage.batch_set_v1(keys, src) == [True] * 4
        flats = [pool.get_data_page(int(i), flat=True) for i in src[::4]]
        d.stop()
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="hicached_client.sglang"):
            for _ in range(10):
                assert storage.batch_exists(keys) == 0
                assert storage.batch_get_v1(keys, dst) == [False] * 4
                assert storage.batch_set_v1(keys, src) == [False] * 4
                assert storage.batch_set(keys, flats) is False  # SGLang's generic page set
        intervals = 1 + int((time.monotonic() - start) // DEFAULT_INTERVAL_S)
        said = [
            r
            for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("hicached_client.sglang")
        ]  # the adapter's (the client's heartbeat thread reports on its own)
        # Three kinds of failure (lookup, load, store): at most one line each per interval.
        assert 3 <= len(said) <= 3 * intervals < 30, "\n".join(r.getMessage()[:160] for r in said)
        # A daemon that is down refused nothing (a review of stop 47: the v1 store said so,
        # and each generic page set logged a line of its own).
        assert not [r for r in said if "refused" in r.getMessage()], [r.getMessage()[:160] for r in said]
        assert storage.refusals.total == 0 and storage.unstored.total == 20
    finally:
        factory.close_all()
        d.stop()


def test_a_header_of_the_format_before_stamps_does_not_block_its_key(storages: StorageFactory) -> None:
    """Fails before the fix (the review of the change): the stamped format kept the header's
    key, where a cached header of the format before stays (the daemon keeps a cached key's
    bytes): the key read as a miss and could not be stored again while that header lived."""
    storage = ours(storages, None)
    assert storage.set("seed", torch.arange(2.0)) is True  # the byte path's session
    blobs = storage._blobs  # writing what a daemon of the old format holds
    old = struct.pack("<8sQ24sI8q", b"hcblob01", 16, b"float32", 1, 4, *[0] * 7)
    chunk = old + bytes(blobs.chunk_bytes - len(old))
    blobs.call(lambda s: s.put_bytes([PageBytes(f"{blobs.keys.daemon_key('old')}#c0", "kv", chunk)]))
    assert storage.exists("old") is False
    value = torch.arange(4.0)
    assert storage.set("old", value) is True
    got = storage.get("old", torch.empty(4))
    assert got is not None and torch.equal(got, value)


def test_a_daemon_that_is_down_ends_a_call_at_its_first_failure() -> None:
    """Fails before the fix (a review against HiCacheFile): a generic batch_get whose page
    load failed because the daemon was down asked the byte path for each key in turn, each
    ask failing after its own timeout (128 keys: 45 s with the daemon killed, ~65 min with it
    hung), and batch_exists waited twice. Now the call ends at the first such failure."""
    d = start_daemon("--l3", "none")
    factory = StorageFactory(d.target)
    try:
        pool = make_host_pool(PoolShape())
        storage = factory.make(pool, model=unique_model())
        keys = sglang_keys(32, 4, first=90_000)
        src = pool.alloc(128)
        assert storage.batch_set_v1(keys, src) == [True] * 32
        targets = [pool.get_data_page(int(i), flat=True).clone() for i in src[::4]]
        assert storage.set("by-key", torch.arange(4.0)) is True  # the byte path's session too
        d.stop()
        start = time.monotonic()
        assert storage.batch_get(keys[:1], targets[:1]) == [None]
        one = time.monotonic() - start
        start = time.monotonic()
        assert storage.batch_get(keys, targets) == [None] * 32
        assert storage.batch_exists(keys) == 0
        took = time.monotonic() - start
        # Two calls of one failed ask each, not 33 + 2 (allowing for a slow machine).
        assert took < 4 * one + 1.0, f"{took:.2f} s for two calls; one key's batch_get took {one:.2f} s"
    finally:
        factory.close_all()
        d.stop()


def test_a_batch_set_without_values_stores_nothing_and_says_so(storages: StorageFactory) -> None:
    """HiCacheFile raises (zip over None); before (a review of stop 47), True came back while
    nothing was stored."""
    storage = ours(storages, make_host_pool(PoolShape()))
    assert storage.batch_set(["nv"], None) is False
    assert storage.exists("nv") is False
    assert storage.batch_set([], None) is True


def test_calls_after_close_are_misses(storages: StorageFactory, caplog: pytest.LogCaptureFixture) -> None:
    pool = make_host_pool(PoolShape())
    storage = ours(storages, pool)
    keys = sglang_keys(2, 4)
    assert storage.batch_set_v1(keys, pool.alloc(8)) == [True, True]
    storage.close()
    with caplog.at_level(logging.WARNING, logger="hicached_client.sglang.storage"):
        assert storage.batch_exists(keys) == 0
        assert storage.batch_get_v1(keys, pool.alloc(8)) == [False, False]
        assert storage.batch_set_v1(keys, pool.alloc(8)) == [False, False]
        assert storage.get("a", torch.empty(3)) is None
        assert storage.set("a", torch.empty(3)) is False
        assert storage.clear() is False
    assert "the storage is closed" in caplog.text


def test_a_tensor_that_lost_a_chunk_is_never_read_wrong() -> None:
    """The byte path's L2 holds 24 chunks and no L3: three tensors of 11, 7 and 7 chunks
    cannot all stay. Fails before the fix (a review against HiCacheFile): a new tensor put
    under the key stored only the chunks the old one had lost, and get stitched the two."""
    d = start_daemon("--l3", "none")
    factory = StorageFactory(d.target)
    try:
        storage = HiCachedStorage(factory.config(model=unique_model(), blob_host_bytes=24 * 16384), {})
        factory.made.append(storage)
        x = torch.randn(10 * 4096)
        assert storage.set("x", x) is True
        assert storage.get("x", torch.empty_like(x)) is not None
        assert storage.set("y0", torch.randn(6 * 4096)) is True
        assert storage.set("y1", torch.randn(6 * 4096)) is True
        readable = storage.get("x", torch.empty_like(x)) is not None
        assert storage.exists("x") is readable  # never "there" but unreadable
        assert not readable, "the old tensor lost a chunk (else the case is not exercised)"
        fresh = torch.randn(10 * 4096)  # same size, other values
        stored = storage.set("x", fresh)
        got = storage.get("x", torch.empty_like(fresh))
        assert stored is (got is not None), "set answers what a get then finds"
        assert got is None or torch.equal(got, fresh), "a tensor read under x is the one put last"
        # Once the old tensor's header is gone, the new tensor is stored whole.
        storage.clear()
        assert storage.set("x", fresh) is True
        got = storage.get("x", torch.empty_like(fresh))
        assert got is not None and torch.equal(got, fresh)
    finally:
        factory.close_all()
        d.stop()


def test_a_write_on_a_replaced_session_goes_to_the_new_one(storages: StorageFactory) -> None:
    """The backup thread took the staging transport; meanwhile the prefetch thread found the
    session gone (daemon restart, lease lost) and attached again. The write must not run into
    the old, freed staging area: it is retried on the new session."""
    pool = make_host_pool(PoolShape())
    storage = ours(storages, pool)
    link = storage.links["kv"]
    keys = sglang_keys(4, 4)
    assert storage.batch_set_v1(keys[:2], pool.alloc(8)) == [True, True]
    old_session, old_transport = link.session, link.transport
    results: dict[str, object] = {}
    with old_transport._write_lock:  # the backup thread is inside its put
        writer = threading.Thread(
            target=lambda: results.setdefault("set", storage.batch_set_v1(keys[2:], pool.alloc(8)))
        )
        writer.start()
        with HiCacheClient(storages.target) as other:  # the daemon forgets the session
            other.session(old_session.session_id, session_secret=old_session.info.session_secret).detach()
        reader = threading.Thread(
            target=lambda: results.setdefault("get", storage.batch_get_v1(keys[:2], pool.alloc(8)))
        )
        reader.start()
        poll(lambda: link.session, lambda s: s is not old_session, 10, "the link attached again")
        assert old_transport._staging._fd is not None  # not freed under the writer
    writer.join(30)
    reader.join(30)
    assert results == {"set": [True, True], "get": [True, True]}
    assert storage.batch_exists(keys) == 4
