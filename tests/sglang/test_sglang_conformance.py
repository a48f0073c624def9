"""Conformance of HiCachedStorage to SGLang's HiCacheStorage interface (v1, generic, v2).

Each storage is built by SGLang's ``StorageBackendFactory.create_backend("dynamic")``
against a live daemon, over real SGLang host pools on CPU. Expectations come
from the interface's docstrings and from SGLang's own ``HiCacheFile``.
"""

from __future__ import annotations

import logging

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError
from hicached_client.sglang import HiCachedStorage
from hicached_client.sglang.refusals import RefusalLog
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolTransfer
from sglang.srt.observability.metrics_collector import StorageMetrics

from tests.sglang.pools import (
    LAYOUTS,
    PoolShape,
    StorageFactory,
    make_host_pool,
    page_bits,
    randomize,
    sglang_keys,
    unique_model,
)
from tests.support.daemon import Daemon

SHAPES = [PoolShape(mla=mla, layout=layout) for mla in (False, True) for layout in LAYOUTS]


def _id(shape: PoolShape) -> str:
    return f"{'mla' if shape.mla else 'mha'}-{shape.layout}"


def test_factory_builds_the_adapter_as_a_server_would(storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model())
    assert isinstance(storage, HiCachedStorage)
    assert storage.links["kv"].binding.host_pool is pool
    assert storage.links["kv"].session.info.pools[0].page_bytes == pool.get_dummy_flat_data_page().numel() * 2


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_v1_round_trip_is_byte_exact(storages: StorageFactory, shape: PoolShape) -> None:
    pool = make_host_pool(shape)
    # 4 pages per daemon call: 10 pages take three batches each way.
    storage = storages.make(pool, model=unique_model(), staging_pages=4)
    keys = sglang_keys(10, shape.page_size)
    src = pool.alloc(10 * shape.page_size)
    want = page_bits(pool, src)
    assert storage.batch_set_v1(keys, src) == [True] * 10
    assert storage.batch_exists(keys) == 10

    dst = pool.alloc(10 * shape.page_size)
    assert page_bits(pool, dst) != want
    assert storage.batch_get_v1(keys, dst) == [True] * 10
    assert page_bits(pool, dst) == want


@pytest.mark.parametrize("shape", SHAPES[:3:2] + SHAPES[4:5], ids=_id)
def test_generic_get_set_match_v1_pages(storages: StorageFactory, shape: PoolShape) -> None:
    pool = make_host_pool(shape)
    storage = storages.make(pool, model=unique_model())
    keys = sglang_keys(3, shape.page_size)
    idx = pool.alloc(3 * shape.page_size)
    flat = [pool.get_data_page(int(i), flat=True).clone() for i in idx[:: shape.page_size]]
    assert storage.batch_set(keys, flat) is True
    # Written through the flat API, read through v1: the same page.
    dst = pool.alloc(3 * shape.page_size)
    assert storage.batch_get_v1(keys, dst) == [True] * 3
    assert page_bits(pool, dst) == page_bits(pool, idx)

    target = pool.get_dummy_flat_data_page()
    got = storage.get(keys[1], target)
    assert got is target
    assert torch.equal(got.view(torch.int16), flat[1].view(torch.int16))
    fresh = storage.get(keys[2])
    assert fresh is not None and torch.equal(fresh.view(torch.int16), flat[2].view(torch.int16))
    assert storage.exists(keys[0]) is True
    assert storage.set(keys[0], flat[0]) is True


def test_exists_counts_the_leading_run(storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model())
    keys = sglang_keys(4, 4)
    assert storage.batch_set_v1(keys[:3], pool.alloc(12)) == [True] * 3
    assert storage.batch_exists(keys) == 3
    assert storage.batch_exists([keys[0], keys[1], "absent", keys[2]]) == 2
    assert storage.batch_exists(["absent", *keys]) == 0
    assert storage.batch_exists([]) == 0
    assert storage.exists(keys[3]) is False


def test_second_set_succeeds_without_rewriting(storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model())
    keys = sglang_keys(2, 4)
    idx = pool.alloc(8)
    first = page_bits(pool, idx)
    assert storage.batch_set_v1(keys, idx) == [True, True]
    randomize(pool)
    assert page_bits(pool, idx) != first
    assert storage.batch_set_v1(keys, idx) == [True, True]  # already stored: success
    assert storage.set(keys[0], pool.get_data_page(int(idx[0]), flat=True)) is True
    dst = pool.alloc(8)
    assert storage.batch_get_v1(keys, dst) == [True, True]
    assert page_bits(pool, dst) == first  # the first write stands


def test_missing_keys_read_as_misses(storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model())
    keys = sglang_keys(3, 4)
    idx = pool.alloc(12)
    assert storage.batch_set_v1([keys[0], keys[2]], torch.cat([idx[:4], idx[8:]])) == [True, True]
    dst = pool.alloc(12)
    untouched = page_bits(pool, dst)
    # Every cached key is loaded, the one after the miss too (as HiCacheFile reads each key).
    assert storage.batch_get_v1(keys, dst) == [True, False, True]
    got, want = page_bits(pool, dst), page_bits(pool, idx)
    assert got[0] == want[0] and got[2] == want[2]
    assert got[1] == untouched[1]
    assert storage.get("never-stored") is None
    # The generic batch_get answers per key, like HiCacheFile.
    found = storage.batch_get(keys)
    assert [f is not None for f in found] == [True, False, True]


def test_misaligned_host_indices_are_rejected(
    storages: StorageFactory, caplog: pytest.LogCaptureFixture
) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model())
    idx = pool.alloc(8)
    # SGLang does not expect its storage to raise (HiCacheFile never does): misses, logged.
    with caplog.at_level(logging.WARNING, logger="hicached_client.sglang.storage"):
        assert storage.batch_set_v1(sglang_keys(2, 4), idx + 1) == [False, False]
    assert "page-aligned" in caplog.text
    caplog.clear()
    storage.failures = RefusalLog(logging.getLogger("hicached_client.sglang.storage"), interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="hicached_client.sglang.storage"):
        assert storage.batch_get_v1(sglang_keys(3, 4), idx) == [False, False, False]
    assert "host indices for 3 pages" in caplog.text


def test_keys_need_not_be_hex(storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model())
    keys = ["a/b", "a%2Fb", "plain key"]
    idx = pool.alloc(12)
    assert storage.batch_set_v1(keys, idx) == [True] * 3
    dst = pool.alloc(12)
    assert storage.batch_get_v1(keys, dst) == [True] * 3
    assert page_bits(pool, dst) == page_bits(pool, idx)


def test_clear_drops_the_model(storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model())
    keys = sglang_keys(3, 4)
    storage.batch_set_v1(keys, pool.alloc(12))
    assert storage.batch_exists(keys) == 3
    assert storage.clear() is True
    assert storage.batch_exists(keys) == 0


def test_get_stats_reports_pages_since_last_call(storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model(), metrics=True)
    keys = sglang_keys(5, 4)
    storage.batch_set_v1(keys, pool.alloc(20))
    storage.batch_get_v1(keys[:2], pool.alloc(8))
    stats = storage.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [5] and stats.prefetch_pgs == [2]
    assert all(b > 0 for b in stats.backup_bandwidth + stats.prefetch_bandwidth)
    assert storage.get_stats().backup_pgs == []


def test_bytes_transport_interoperates_with_shm(storages: StorageFactory) -> None:
    model = unique_model()
    pool = make_host_pool(PoolShape(layout="page_first"))
    writer = storages.make(pool, model=model)
    reader = storages.make(pool, model=model, transport="bytes")
    keys = sglang_keys(6, 4)
    idx = pool.alloc(24)
    assert writer.batch_set_v1(keys[:3], idx[:12]) == [True] * 3
    assert reader.batch_set_v1(keys[3:], idx[12:]) == [True] * 3
    for storage in (writer, reader):
        dst = pool.alloc(24)
        assert storage.batch_get_v1(keys, dst) == [True] * 6
        assert page_bits(pool, dst) == page_bits(pool, idx)
        pool.free(dst)


def test_close_detaches_every_session(daemon: Daemon, storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model())
    session_id = storage.links["kv"].session.session_id
    with HiCacheClient(daemon.target) as client:
        probe = client.session(session_id, session_secret=storage.links["kv"].session.info.session_secret)
        probe.heartbeat()
        storage.close()
        storage.close()
        with pytest.raises(HiCacheError) as err:
            probe.heartbeat()
        assert err.value.code == grpc.StatusCode.NOT_FOUND


# ----------------------------------------------------------------------- v2


def _side_pools() -> tuple[object, object, object]:
    kv = make_host_pool(PoolShape())
    swa = make_host_pool(PoolShape(layout="page_first", layers=1, heads=1, head_dim=16))
    # "page_head" has no chunked binding: exercises the per-page flat path.
    idx = make_host_pool(PoolShape(layout="page_head", layers=1))
    return kv, swa, idx


def test_v2_multi_pool_round_trip_and_hit_policies(storages: StorageFactory) -> None:
    kv, swa, indexer = _side_pools()
    storage = storages.make(kv, model=unique_model())
    anchor = storage.links["kv"].session.session_id
    storage.register_mem_host_pool_v2(kv, "kv")
    storage.register_mem_host_pool_v2(swa, "swa")
    storage.register_mem_host_pool_v2(indexer, "indexer")
    assert storage.links["kv"].session.session_id == anchor  # the KV pool again: same session
    assert len({link.session.session_id for link in storage.links.values()}) == 3
    keys = sglang_keys(6, 4)
    kv_idx, swa_idx, ix_idx = kv.alloc(24), swa.alloc(24), indexer.alloc(16)
    # KV: all 6 pages; indexer (ALL_PAGES): the first 4; swa (TRAILING_PAGES, window 2): pages 2..5.
    result = storage.batch_set_v2(
        [
            PoolTransfer(name="kv", keys=keys, host_indices=kv_idx),
            PoolTransfer(name="indexer", keys=keys[:4], host_indices=ix_idx),
            PoolTransfer(name="swa", keys=keys[2:], host_indices=swa_idx[8:]),
        ]
    )
    assert result == {"kv": [True] * 6, "indexer": [True] * 4, "swa": [True] * 4}

    # The same key strings in another pool are other pages: swa holds nothing for keys[:2].
    swa_only = storage.batch_exists_v2(
        keys, [PoolTransfer(name="swa", keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    )
    assert swa_only.kv_hit_pages == 6
    assert swa_only.restorable_prefix_pages == [4, 5, 6]
    assert swa_only.extra_pool_hit_pages == {"kv": 6, "swa": 6}

    both = storage.batch_exists_v2(
        keys,
        [
            PoolTransfer(name="indexer", keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(name="swa", keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ],
    )
    assert both.kv_hit_pages == 4
    assert both.restorable_prefix_pages == [4]
    assert both.extra_pool_hit_pages == {"kv": 6, "indexer": 4, "swa": 6}

    got = storage.batch_get_v2(
        [
            PoolTransfer(name="indexer", keys=keys, host_indices=indexer.alloc(24)),
            PoolTransfer(name="swa", keys=keys[3:], host_indices=(swa_dst := swa.alloc(12))),
        ]
    )
    assert got == {"indexer": [True] * 4 + [False] * 2, "swa": [True] * 3}
    assert page_bits(swa, swa_dst) == page_bits(swa, swa_idx[12:])
    ix_dst = indexer.alloc(16)
    assert storage.batch_get_v2([PoolTransfer(name="indexer", keys=keys[:4], host_indices=ix_dst)]) == {
        "indexer": [True] * 4
    }
    assert page_bits(indexer, ix_dst) == page_bits(indexer, ix_idx)


def test_v2_rejects_length_mismatch_and_unknown_pools(
    storages: StorageFactory, caplog: pytest.LogCaptureFixture
) -> None:
    kv, _, _ = _side_pools()
    storage = storages.make(kv, model=unique_model())
    keys = sglang_keys(2, 4)
    assert storage.batch_set_v2([PoolTransfer(name="kv", keys=keys, host_indices=kv.alloc(4))]) == {
        "kv": [False, False]
    }
    # An unregistered pool is misses, never an exception into SGLang (it used to raise ValueError).
    with caplog.at_level(logging.WARNING, logger="hicached_client.sglang.storage"):
        got = storage.batch_get_v2([PoolTransfer(name="mamba", keys=keys, host_indices=kv.alloc(8))])
    assert got == {"mamba": [False, False]}
    assert "pool mamba: not registered" in caplog.text
    storage.register_mem_host_pool_v2(make_host_pool(PoolShape()), "draft")
    assert storage.batch_set_v1(keys, kv.alloc(8)) == [True, True]
    block = PoolTransfer(name="draft", keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    with pytest.raises(ValueError, match="unsupported pool hit policy"):
        storage.batch_exists_v2(keys, [block])


def test_hicachefile_reference_agrees_on_v2_policies(storages: StorageFactory, tmp_path: object) -> None:
    """The same scenario through SGLang's HiCacheFile gives the same PoolTransferResult."""
    kv, swa, indexer = _side_pools()
    cfg = storages.config(model=unique_model())
    cfg.extra_config = {"file_storage_path": str(tmp_path)}
    ref = HiCacheFile(cfg)
    ours = storages.make(kv, model=unique_model())
    keys = sglang_keys(6, 4)
    kv_idx, swa_idx, ix_idx = kv.alloc(24), swa.alloc(12), indexer.alloc(8)
    for backend in (ref, ours):
        backend.register_mem_host_pool_v2(kv, "kv")
        backend.register_mem_host_pool_v2(swa, "swa")
        backend.register_mem_host_pool_v2(indexer, "indexer")
        backend.batch_set_v2(
            [
                PoolTransfer(name="kv", keys=keys[:5], host_indices=kv_idx[:20]),
                PoolTransfer(name="indexer", keys=[keys[0], keys[1]], host_indices=ix_idx),
                PoolTransfer(name="swa", keys=[keys[1], keys[3], keys[4]], host_indices=swa_idx),
            ]
        )
    query = [
        PoolTransfer(name="swa", keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name="indexer", keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
    ]
    want = ref.batch_exists_v2(keys, query)
    got = ours.batch_exists_v2(keys, query)
    assert (want.kv_hit_pages, want.restorable_prefix_pages) == (0, [])
    assert {str(k): v for k, v in want.extra_pool_hit_pages.items()} == {"kv": 5, "swa": 5, "indexer": 2}
    assert (got.kv_hit_pages, got.restorable_prefix_pages) == (
        want.kv_hit_pages,
        want.restorable_prefix_pages,
    )
    assert {str(k): v for k, v in got.extra_pool_hit_pages.items()} == {
        str(k): v for k, v in want.extra_pool_hit_pages.items()
    }
