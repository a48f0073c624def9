"""HiCachedStorage gives SGLang's HiCacheFile results for the same call sequence.

Every scenario runs one list of calls against ``HiCacheFile`` (in a temp dir)
and against ``HiCachedStorage`` (on a live daemon), without a registered host
pool and with one, and compares the normalised results: tensors by their bytes,
``PoolTransferResult`` by its fields. Before the byte path, every generic call
on a storage without a pool raised ``ValueError: pool 'kv' is not registered``,
and a tensor that was not one KV page failed in ``flat_to_chunks``.

Also here: a write the daemon refuses (no room, or over a configured limit) is
logged, rate-limited, with the daemon's reason (before, ``ok=false`` was passed
back silently and a limit logged a warning per call).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hicached_client.sglang import HiCachedStorage
from hicached_client.sglang.refusals import RefusalLog
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolTransfer, PoolTransferResult

from tests.sglang.pools import PoolShape, StorageFactory, make_host_pool, page_bits, sglang_keys, unique_model
from tests.support.daemon import start_daemon

Backend = Any
Calls = Callable[[Backend], list[object]]


def norm(value: object) -> object:
    """Results comparable across backends."""
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            value.dtype,
            tuple(value.shape),
            value.contiguous().view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(value, PoolTransferResult):
        extra = {str(k): v for k, v in value.extra_pool_hit_pages.items()}
        return ("ptr", value.kv_hit_pages, extra, value.restorable_prefix_pages)
    if isinstance(value, list | tuple):
        return [norm(v) for v in value]
    if isinstance(value, dict):
        return {str(k): norm(v) for k, v in value.items()}
    return value


def reference(storages: StorageFactory, tmp_path: Path, host_pool: Any | None) -> HiCacheFile:
    cfg = storages.config(model=unique_model())
    cfg.extra_config = {"file_storage_path": str(tmp_path / "hicachefile")}
    ref = HiCacheFile(cfg)
    if host_pool is not None:
        ref.register_mem_pool_host(host_pool)
        ref.register_mem_host_pool_v2(host_pool, "kv")
    return ref


def ours(storages: StorageFactory, host_pool: Any | None, **options: Any) -> HiCachedStorage:
    if host_pool is not None:
        storage = storages.make(host_pool, model=unique_model(), **options)
        storage.register_mem_host_pool_v2(host_pool, "kv")
        return storage
    # No registration at all: what SGLang has right after construction.
    storage = HiCachedStorage(storages.config(model=unique_model(), **options), {})
    storages.made.append(storage)
    return storage


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(37, generator=gen),
        "b": torch.randn(3, 5000, generator=gen).to(torch.bfloat16),  # 30 KB: two chunks
        "c": torch.arange(10, dtype=torch.int64),
        "big": torch.randn(70_000, generator=gen),  # 280 KB: 18 chunks, several messages
        "other": torch.zeros(37),
    }


def generic_calls(backend: Backend) -> list[object]:
    t = tensors()
    like = {k: torch.empty_like(v) for k, v in t.items()}
    return [
        backend.exists("a"),
        backend.get("a", torch.empty_like(t["a"])),
        backend.batch_exists(["a", "b"]),
        backend.set("a", t["a"]),
        backend.set("b", t["b"]),
        backend.exists("a"),
        backend.exists("x"),
        backend.batch_exists(["a", "b", "x", "c"]),
        backend.get("a", like["a"]),
        backend.batch_get(["a", "x", "b"], [torch.empty_like(t["a"]), torch.empty_like(t["a"]), like["b"]]),
        backend.set("a", t["other"]),  # already stored: success, no rewrite
        backend.get("a", torch.empty_like(t["a"])),
        backend.batch_set(["c", "big"], [t["c"], t["big"]]),
        backend.batch_get(["big", "c"], [like["big"], like["c"]]),
        backend.batch_exists(["a", "b", "c", "big", "y"]),
        backend.batch_exists_v2(["a", "b", "x"]),
        backend.batch_exists_v2(["y"]),
    ]


def run_both(ref: Backend, mine: Backend, calls: Calls) -> list[object]:
    want = norm(calls(ref))
    got = norm(calls(mine))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"call #{i} differs: hicached {str(g)[:200]} != HiCacheFile {str(w)[:200]}"
    return got  # type: ignore[return-value]


def test_generic_api_without_a_pool_matches_hicachefile(storages: StorageFactory, tmp_path: Path) -> None:
    run_both(reference(storages, tmp_path, None), ours(storages, None), generic_calls)


def test_generic_api_with_a_pool_matches_hicachefile(storages: StorageFactory, tmp_path: Path) -> None:
    pool = make_host_pool(PoolShape())
    run_both(reference(storages, tmp_path, pool), ours(storages, pool), generic_calls)


def test_byte_path_tensors_are_seen_by_another_storage_of_the_model(storages: StorageFactory) -> None:
    """A tensor stored by key in one process's storage is found by a second one (shared group)."""
    model = unique_model()
    first = HiCachedStorage(storages.config(model=model), {})
    second = HiCachedStorage(storages.config(model=model), {})
    storages.made += [first, second]
    value = torch.randn(4, 4097)
    assert first.set("shared", value) is True
    assert second.exists("shared") is True
    got = second.get("shared")  # no target: dtype and shape come from the stored header
    assert got is not None and got.dtype == value.dtype and torch.equal(got, value)
    # Another model's storage does not see it.
    other = HiCachedStorage(storages.config(model=unique_model()), {})
    storages.made.append(other)
    assert other.exists("shared") is False


def test_page_calls_before_registration_are_misses(
    storages: StorageFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """v1/v2 before any pool is registered: misses and failed writes, logged, no exception."""
    storage = ours(storages, None)
    keys = sglang_keys(2, 4)
    idx = torch.arange(8, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="hicached_client.sglang.storage"):
        assert storage.batch_set_v1(keys, idx) == [False, False]
        assert storage.batch_get_v1(keys, idx) == [False, False]
        assert storage.batch_set_v2([PoolTransfer(name="kv", keys=keys, host_indices=idx)]) == {
            "kv": [False, False]
        }
        assert storage.batch_get_v2([PoolTransfer(name="kv", keys=keys, host_indices=idx)]) == {
            "kv": [False, False]
        }
        swa = [PoolTransfer(name="swa", keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        assert norm(storage.batch_exists_v2(keys, swa)) == ("ptr", 0, {}, [])
    assert "pool kv: not registered" in caplog.text


def pool_calls(pool: Any) -> Calls:
    """Page traffic: generic writes of flat KV pages read through v2 and back, and v2 existence."""

    def calls(backend: Backend) -> list[object]:
        keys = sglang_keys(4, 4)
        src = pool.alloc(16)
        flats = [pool.get_data_page(int(i), flat=True).clone() for i in src[::4]]
        out: list[object] = [
            backend.set("p0", flats[0]),
            backend.batch_set(["p1", "p2"], flats[1:3]),
            backend.batch_exists(["p0", "p1", "p2", "zz"]),
        ]
        want = page_bits(pool, src)
        dst = pool.alloc(16)
        out.append(
            backend.batch_get_v2([PoolTransfer(name="kv", keys=["p0", "p1", "p2", "zz"], host_indices=dst)])
        )
        out.append(page_bits(pool, dst[:12]) == want[:3])
        out.append(backend.batch_set_v2([PoolTransfer(name="kv", keys=keys[:3], host_indices=src[:12])]))
        got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        out.append(
            [
                g is not None and g.view(torch.uint8).numpy().tobytes() == w
                for g, w in zip(got, want, strict=True)
            ]
        )
        out.append(backend.batch_exists_v2(keys))
        out.append(backend.batch_exists(keys))
        dst2 = pool.alloc(16)
        out.append(backend.batch_get_v2([PoolTransfer(name="kv", keys=keys, host_indices=dst2)]))
        out.append(page_bits(pool, dst2[:12]) == want[:3])
        for idx in (src, dst, dst2):
            pool.free(idx)
        return out

    return calls


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_page_api_with_a_pool_matches_hicachefile(
    storages: StorageFactory, tmp_path: Path, layout: str
) -> None:
    pool = make_host_pool(PoolShape(layout=layout))
    got = run_both(reference(storages, tmp_path, pool), ours(storages, pool), pool_calls(pool))
    # The bytes arrived (not merely "both backends disagree with the source alike").
    assert got[4] is True and got[6] == [True, True, True, False] and got[10] is True


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_set_unflattened_are_read_by_v1_and_v2_as_hicachefile_reads_them(
    storages: StorageFactory, tmp_path: Path, layout: str
) -> None:
    """A page handed to the generic ``batch_set`` as the pool's own view (``get_data_page(i,
    flat=False)``, not contiguous) is a page of the pool, as HiCacheFile stores its bytes.
    Before (a review of stop 47), it went to the byte path: ``batch_exists`` counted it and
    ``batch_get_v2`` / ``batch_get_v1`` missed it."""
    pool = make_host_pool(PoolShape(layout=layout))

    def calls(backend: Backend) -> list[object]:
        keys = sglang_keys(2, 4, first=4_000)
        src = pool.alloc(8)
        pages = [pool.get_data_page(int(i), flat=False) for i in src[::4]]
        out: list[object] = [backend.batch_set(keys, pages), backend.batch_exists(keys)]
        dst = pool.alloc(8)
        out.append(backend.batch_get_v2([PoolTransfer(name="kv", keys=keys, host_indices=dst)]))
        out.append(page_bits(pool, dst) == page_bits(pool, src))
        if isinstance(backend, HiCachedStorage):
            dst1 = pool.alloc(8)
            assert backend.batch_get_v1(keys, dst1) == [True, True]
            assert page_bits(pool, dst1) == page_bits(pool, src)
            pool.free(dst1)
        for idx in (src, dst):
            pool.free(idx)
        return out

    got = run_both(reference(storages, tmp_path, pool), ours(storages, pool), calls)
    assert got == [True, 2, {"kv": [True, True]}, True]


def test_v1_matches_hicachefile_v2_kv(storages: StorageFactory, tmp_path: Path) -> None:
    """HiCacheFile has no v1 (its methods return None); v1 answers what its v2 answers for the KV pool."""
    pool = make_host_pool(PoolShape())
    ref, mine = reference(storages, tmp_path, pool), ours(storages, pool)
    keys = sglang_keys(5, 4)
    src = pool.alloc(12)
    want_set = ref.batch_set_v2([PoolTransfer(name="kv", keys=keys[:3], host_indices=src)])["kv"]
    assert mine.batch_set_v1(keys[:3], src) == want_set
    a, b = pool.alloc(20), pool.alloc(20)
    want_get = ref.batch_get_v2([PoolTransfer(name="kv", keys=keys, host_indices=a)])["kv"]
    assert mine.batch_get_v1(keys, b) == want_get == [True] * 3 + [False] * 2
    assert page_bits(pool, a[:12]) == page_bits(pool, b[:12]) == page_bits(pool, src)


# Which of six keys are stored: misses in the middle and at the end.
GAPS = [True, False, True, True, False, True]


def gap_calls(pool: Any) -> Calls:
    """Gets of keys with misses between hits: v2, the generic batch_get, and the bytes of both."""

    def calls(backend: Backend) -> list[object]:
        keys = sglang_keys(len(GAPS), 4, first=len(GAPS) * 4 * 7)
        stored = [k for k, s in zip(keys, GAPS, strict=True) if s]
        src = pool.alloc(4 * len(stored))
        want = page_bits(pool, src)
        out: list[object] = [backend.batch_set_v2([PoolTransfer(name="kv", keys=stored, host_indices=src)])]
        dst = pool.alloc(4 * len(keys))
        out.append(backend.batch_get_v2([PoolTransfer(name="kv", keys=keys, host_indices=dst)]))
        got = page_bits(pool, dst)
        out.append([got[i] for i, s in enumerate(GAPS) if s] == want)
        flats = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        stored_bits = iter(want)
        out.append(  # per key: a miss (None), or whether the bytes are the stored page's
            [
                None if f is None else (s and f.view(torch.uint8).numpy().tobytes() == next(stored_bits))
                for f, s in zip(flats, GAPS, strict=True)
            ]
        )
        for idx in (src, dst):
            pool.free(idx)
        return out

    return calls


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_gets_after_a_miss_match_hicachefile(storages: StorageFactory, tmp_path: Path, layout: str) -> None:
    """HiCacheFile reads every key's file; the adapter loads every cached key, not only the
    leading run (before: [True, False, False, False, False, False])."""
    pool = make_host_pool(PoolShape(layout=layout))
    got = run_both(reference(storages, tmp_path, pool), ours(storages, pool), gap_calls(pool))
    assert got[1] == {"kv": GAPS}
    assert got[2] is True
    assert got[3] == [True if s else None for s in GAPS]


def test_pages_after_a_miss_are_loaded_from_l3(tmp_path: Path) -> None:
    """A restarted daemon has the pages in its L3 only: v1 still loads each cached key, also
    after a miss (the per-key Lookup asks L3), and the bytes are the stored ones."""
    l3 = tmp_path / "l3"
    pool = make_host_pool(PoolShape())
    keys = sglang_keys(len(GAPS), 4, first=len(GAPS) * 4 * 11)
    stored = [k for k, s in zip(keys, GAPS, strict=True) if s]
    src = pool.alloc(4 * len(stored))
    model = unique_model()
    for round_ in range(2):
        daemon = start_daemon("--l3", "file", "--l3-path", str(l3))
        storages = StorageFactory(daemon.target)
        try:
            storage = storages.make(pool, model=model)
            if round_ == 0:
                assert storage.batch_set_v1(stored, src) == [True] * len(stored)
                daemon_keys = storage.links["kv"].keys.daemon_keys(stored)
                done = storage.links["kv"].call(lambda s, _: s.backup(daemon_keys, wait=True))  # noqa: B023
                assert done.stored_pages == done.queued_pages  # 0 when write-through was first
                continue  # the clean stop flushes what is still queued
            assert storage.batch_exists(keys) == 1  # a new daemon: nothing in its L2
            dst = pool.alloc(4 * len(keys))
            assert storage.batch_get_v1(keys, dst) == GAPS
            got = page_bits(pool, dst)
            assert [got[i] for i, s in enumerate(GAPS) if s] == page_bits(pool, src)
        finally:
            storages.close_all()
            daemon.stop()


# ------------------------------------------------------------------ refused writes


def test_a_refused_page_write_logs_the_daemons_reason(
    storages: StorageFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The group holds 2 pages; a 4-page write is refused and the log says why (once, rate-limited)."""
    pool = make_host_pool(PoolShape())
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    storage = ours(storages, pool, host_bytes=2 * page_bytes)
    keys = sglang_keys(4, 4)
    with caplog.at_level(logging.WARNING, logger="hicached_client.sglang.storage"):
        assert storage.batch_set_v1(keys, pool.alloc(16)) == [False] * 4
        assert storage.batch_set_v1(keys, pool.alloc(16)) == [False] * 4
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "refused to store 4 pages of pool kv" in lines[0]
    assert "no room for 4 pages" in lines[0]
    assert storage.refusals.total == 2
    assert storage.batch_exists(keys) == 0


def test_a_refused_byte_write_logs_the_daemons_reason(
    storages: StorageFactory, caplog: pytest.LogCaptureFixture
) -> None:
    storage = ours(storages, None, blob_host_bytes=4 * 16384)
    with caplog.at_level(logging.WARNING, logger="hicached_client.sglang.storage"):
        assert storage.set("huge", torch.zeros(64 * 1024)) is False  # 256 KiB: 17 chunks
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "pool blob" in lines[0] and "no host room" in lines[0], lines
    assert storage.exists("huge") is False
    assert storage.set("small", torch.zeros(8)) is True


def test_a_write_over_a_daemon_limit_logs_the_limit_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """A PutPages over a configured limit (RESOURCE_EXHAUSTED) is a refusal like ``ok=false``:
    ``False`` to SGLang, one rate-limited line naming the limit. Before: a WARNING per call
    ("storing 4 pages of pool kv failed"), never counted in ``refusals``."""
    daemon = start_daemon("--set", "limits.max_keys_per_request=2")
    storages = StorageFactory(daemon.target)
    try:
        pool = make_host_pool(PoolShape())
        storage = ours(storages, pool, staging_pages=4)
        keys = sglang_keys(4, 4)
        with caplog.at_level(logging.WARNING, logger="hicached_client.sglang"):
            assert storage.batch_set_v1(keys, pool.alloc(16)) == [False] * 4
            assert storage.batch_set_v1(keys, pool.alloc(16)) == [False] * 4
            assert storage.batch_set_v1(keys[:2], pool.alloc(8)) == [True] * 2  # within the limit
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1, lines
        assert "refused to store 4 pages of pool kv" in lines[0] and "limits.max_keys_per_request" in lines[0]
        assert storage.refusals.total == 2
    finally:
        storages.close_all()
        daemon.stop()


def test_refusal_log_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    refusals = RefusalLog(logging.getLogger("t.refusals"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t.refusals"):
        refusals.refused("kv", 4, "no room")
        now[0] += 1
        refusals.refused("kv", 4, "no room")
        refusals.refused("kv", 2, "no room")
        now[0] += 10
        refusals.refused("kv", 1, "over budget")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "hicached: daemon refused to store 4 pages of pool kv: no room",
        "hicached: daemon refused to store 1 pages of pool kv: over budget (2 more since the last report)",
    ]
    assert refusals.total == 4


def long_key_calls(pool: Any) -> Calls:
    """A key no backend can store (600 bytes: past HiCacheFile's file name and the daemon's
    ``limits.max_key_bytes``) among stored ones."""

    def calls(backend: Backend) -> list[object]:
        keys = sglang_keys(3, 4, first=9000)
        src = pool.alloc(12)
        out: list[object] = [backend.batch_set_v2([PoolTransfer(name="kv", keys=keys, host_indices=src)])]
        long = "k" * 600
        out.append(backend.batch_exists([*keys[:2], long, keys[2]]))
        out.append(backend.batch_exists([long, *keys]))
        out.append(backend.exists(long))
        pool.free(src)
        return out

    return calls


def test_a_key_too_long_to_store_ends_the_leading_run_as_in_hicachefile(
    storages: StorageFactory, tmp_path: Path
) -> None:
    """Fails before (a review of stop 44): the daemon refused the whole lookup for one key over
    its limit, so batch_exists answered 0 where HiCacheFile counts the run before that key."""
    pool = make_host_pool(PoolShape())
    got = run_both(reference(storages, tmp_path, pool), ours(storages, pool), long_key_calls(pool))
    assert got[1:] == [2, 0, False]
