"""Pages shared (or not) between SGLang storage instances through one daemon.

Sharing follows SGLang's file backend: same model and rank (or any rank for
MLA) share; another TP rank of an MHA model, another model, another tenant or
another cache_salt never hits.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hicached_client import HiCacheClient
from hicached_client.sglang import HiCachedStorage

from tests.sglang.pools import (
    PoolShape,
    StorageFactory,
    digest,
    make_host_pool,
    page_bits,
    randomize,
    sglang_keys,
    unique_model,
)
from tests.support.daemon import Daemon, start_daemon
from tests.support.state import stop_process
from tests.support.zygote import Forked, Zygote

ROOT = Path(__file__).resolve().parents[2]


def _copy_pages(
    writer: Any, reader: Any, pool_w: Any, pool_r: Any, keys: list[str]
) -> tuple[list[bool], bool]:
    src = pool_w.alloc(len(keys) * pool_w.page_size)
    assert writer.batch_set_v1(keys, src) == [True] * len(keys)
    dst = pool_r.alloc(len(keys) * pool_r.page_size)
    got = reader.batch_get_v1(keys, dst)
    return got, page_bits(pool_r, dst) == page_bits(pool_w, src)


def test_two_instances_of_one_model_share_pages(storages: StorageFactory) -> None:
    model = unique_model()
    pool_a, pool_b = make_host_pool(PoolShape()), make_host_pool(PoolShape())
    a = storages.make(pool_a, model=model)
    b = storages.make(pool_b, model=model)
    assert a.config.instance_id != b.config.instance_id
    got, exact = _copy_pages(a, b, pool_a, pool_b, sglang_keys(5, 4))
    assert got == [True] * 5 and exact


def _kv_at(pool: Any, slot: int, plane: int, layer: int) -> Any:
    """The K (plane 0) or V (1) row of one token slot and layer, as SGLang's layout means it."""
    b, ps = pool.kv_buffer, pool.page_size
    if pool.layout == "layer_first":
        return b[plane, layer, slot]
    if pool.layout == "page_first":
        return b[plane, slot, layer]
    return b[plane, slot // ps, layer, slot % ps]  # page_first_direct


@pytest.mark.parametrize(
    ("writer", "reader", "shared", "v_head_dim"),
    [
        ("layer_first", "page_first", False, None),
        ("page_first", "layer_first", False, None),
        ("page_first", "page_first_direct", False, None),
        ("layer_first", "page_first_direct", True, None),
        ("page_first_direct", "layer_first", True, None),
        # V narrower than K: the per-page (flat page) binding, kept apart the same way.
        ("layer_first", "page_first", False, 4),
    ],
)
def test_pools_of_two_layouts_share_pages_only_where_they_mean_the_same_kv(
    storages: StorageFactory, writer: str, reader: str, shared: bool, v_head_dim: int | None
) -> None:
    """Fails before (a review of stop 46): a layer_first and a page_first pool of one model
    (a second replica, or a restart with another --hicache-mem-layout) shared a pool group,
    but their staged pages hold the rows in other orders (layer by layer, token by token):
    the reader's get answered True with every token's KV scrambled. HiCacheFile has the same
    flaw. Now those two orders never share a group (a miss); layouts of one order still share."""
    model = unique_model()
    pool_w = make_host_pool(PoolShape(layout=writer, device_tokens=64, v_head_dim=v_head_dim))
    pool_r = make_host_pool(PoolShape(layout=reader, device_tokens=64, v_head_dim=v_head_dim))
    src = pool_w.alloc(4)
    for slot in src.tolist():
        for plane in range(2):
            for layer in range(pool_w.layer_num):
                _kv_at(pool_w, slot, plane, layer).fill_(float(1000 * plane + 100 * layer + slot % 4))
    keys = sglang_keys(1, 4, first=50_000)
    assert storages.make(pool_w, model=model).batch_set_v1(keys, src) == [True]
    dst = pool_r.alloc(4)
    got = storages.make(pool_r, model=model).batch_get_v1(keys, dst)
    assert got == [shared], (writer, reader, got)
    if shared:
        for s_, d_ in zip(src.tolist(), dst.tolist(), strict=True):
            for plane in range(2):
                for layer in range(pool_r.layer_num):
                    assert bool((_kv_at(pool_r, d_, plane, layer) == _kv_at(pool_w, s_, plane, layer)).all())


def test_mha_tp_ranks_never_see_each_others_pages(storages: StorageFactory) -> None:
    model = unique_model()
    pools = [make_host_pool(PoolShape()) for _ in range(2)]
    ranks = [storages.make(p, model=model, tp_rank=r, tp_size=2) for r, p in enumerate(pools)]
    keys = sglang_keys(3, 4)
    # Both ranks write the same keys with their own shard's bytes.
    idx = [p.alloc(12) for p in pools]
    for rank, i in zip(ranks, idx, strict=True):
        assert rank.batch_set_v1(keys, i) == [True] * 3
    for rank, pool, i in zip(ranks, pools, idx, strict=True):
        dst = pool.alloc(12)
        assert rank.batch_get_v1(keys, dst) == [True] * 3
        assert page_bits(pool, dst) == page_bits(pool, i)
    only0 = sglang_keys(2, 4, first=1000)
    ranks[0].batch_set_v1(only0, pools[0].alloc(8))
    assert ranks[1].batch_exists(only0) == 0


def test_mla_pages_are_shared_across_tp_ranks(storages: StorageFactory) -> None:
    model = unique_model()
    pools = [make_host_pool(PoolShape(mla=True, layout="page_first")) for _ in range(2)]
    r0 = storages.make(pools[0], model=model, tp_rank=0, tp_size=2)
    r1 = storages.make(pools[1], model=model, tp_rank=1, tp_size=2)
    got, exact = _copy_pages(r0, r1, pools[0], pools[1], sglang_keys(4, 4))
    assert got == [True] * 4 and exact


@pytest.mark.parametrize("other", ["model", "tenant", "cache_salt", "pp_rank"])
def test_other_namespace_never_hits(storages: StorageFactory, other: str) -> None:
    model = unique_model()
    pool = make_host_pool(PoolShape())
    writer = storages.make(pool, model=model, tenant="team-a", pp_size=2)
    keys = sglang_keys(3, 4)
    assert writer.batch_set_v1(keys, pool.alloc(12)) == [True] * 3
    same = storages.make(make_host_pool(PoolShape()), model=model, tenant="team-a", pp_size=2)
    assert same.batch_exists(keys) == 3
    kwargs: dict[str, Any] = {"model": model, "tenant": "team-a", "pp_size": 2}
    probe_keys = keys
    if other == "model":
        kwargs["model"] = unique_model()
    elif other == "tenant":
        kwargs["tenant"] = "team-b"
    elif other == "pp_rank":
        kwargs["pp_rank"] = 1
    else:
        # SGLang seeds the key chain with the request's cache_salt.
        probe_keys = sglang_keys(3, 4, cache_salt="salt")
        assert probe_keys != keys
    reader = storages.make(make_host_pool(PoolShape()), **kwargs)
    assert reader.batch_exists(probe_keys) == 0
    assert reader.batch_get_v1(probe_keys, reader.links["kv"].binding.host_pool.alloc(12)) == [False] * 3


def test_clear_of_one_tenant_keeps_the_other(storages: StorageFactory) -> None:
    model = unique_model()
    pool = make_host_pool(PoolShape())
    a = storages.make(pool, model=model, tenant="a")
    b = storages.make(pool, model=model, tenant="b")
    keys = sglang_keys(2, 4)
    a.batch_set_v1(keys, pool.alloc(8))
    b.batch_set_v1(keys, pool.alloc(8))
    assert a.clear() is True
    assert (a.batch_exists(keys), b.batch_exists(keys)) == (0, 2)


@pytest.fixture(scope="module")
def ranks() -> Iterator[Zygote]:
    """Forks each rank process from one that has imported SGLang (~10 s a process otherwise)."""
    # This checkout's daemon AND client (an installed hicached_client may be another checkout's).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients" / "python")])}
    zygote = Zygote(["tests.sglang.worker"], env=env)
    yield zygote
    zygote.close()


def _worker(ranks: Zygote, daemon: Daemon, **args: Any) -> Forked:
    return ranks.start("tests.sglang.worker", [json.dumps({"target": daemon.target, **args})])


def _result(proc: Forked) -> dict[str, Any]:
    done = proc.wait(timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_rank_processes_agree_on_pages_written_by_another_process(
    ranks: Zygote, daemon: Daemon, storages: StorageFactory
) -> None:
    """One process writes; two MLA TP-rank processes read concurrently, and so does this one."""
    model = unique_model("proc")
    shape = {"mla": True, "layout": "layer_first"}
    keys = sglang_keys(6, 4)
    writer = _result(
        _worker(
            ranks, daemon, op="write", seed=7, keys=keys, shape=shape, storage={"model": model, "tp_size": 2}
        )
    )
    assert writer["results"] == [True] * 6
    readers = [
        _worker(
            ranks,
            daemon,
            op="read",
            keys=keys,
            shape=shape,
            storage={"model": model, "tp_rank": r, "tp_size": 2},
        )
        for r in range(2)
    ]
    pool = make_host_pool(PoolShape(mla=True, layout="layer_first"))
    local = storages.make(pool, model=model, tp_rank=1, tp_size=2)
    dst = pool.alloc(24)
    assert local.batch_get_v1(keys, dst) == [True] * 6
    results = [_result(p) for p in readers]
    for r in results:
        assert r["results"] == [True] * 6
    assert {r["digest"] for r in results} == {writer["digest"]} == {digest(page_bits(pool, dst))}


def test_stores_that_timed_out_while_the_daemon_stalled_never_land_later(daemon: Daemon) -> None:
    """Fails before (a review's repro, the default path: staging and the fast lane): two stores
    timed out while the daemon was stopped; each lane op stayed in the ring, the second store
    refilled the staging half the first had used, and once resumed the daemon ran the first,
    storing the second batch's bytes under the first batch's keys, read back as a hit. Now a
    timed-out lane op closes the lane, the daemon never runs it, and both read as misses."""
    factory = StorageFactory(daemon.target)
    try:
        pool = make_host_pool(PoolShape())
        storage: HiCachedStorage = factory.make(pool, model=unique_model(), timeout_s=1.0)
        first, second = sglang_keys(4, 4), sglang_keys(4, 4, first=1000)
        src_a, src_b, dst = pool.alloc(16), pool.alloc(16), pool.alloc(16)
        randomize(pool, seed=11)
        assert storage.batch_exists(first) == 0  # the session and its lane are open
        stop_process(daemon.process.pid)
        try:
            assert storage.batch_set_v1(first, src_a) == [False] * 4
            assert storage.batch_set_v1(second, src_b) == [False] * 4
        finally:
            os.kill(daemon.process.pid, signal.SIGCONT)
        got = storage.batch_get_v1(first, dst)
        assert got == [False] * 4 or page_bits(pool, dst) == page_bits(pool, src_a), got
        assert storage.batch_get_v1(second, dst) == [False] * 4 or page_bits(pool, dst) == page_bits(
            pool, src_b
        )
    finally:
        factory.close_all()


def test_pages_of_a_mebibyte_read_back_over_the_byte_path(daemon: Daemon, storages: StorageFactory) -> None:
    """Fails before: the byte path (GetBytes) asked for SGLang's whole batch in one answer, so
    40 pages of 1 MiB (over the daemon's 32 MiB limits.max_response_bytes) were stored and
    found but never read back. Now each byte-path call keeps to 16 MiB."""
    n = 40
    shape = PoolShape(layers=16, heads=8, head_dim=128, page_size=16, device_tokens=n * 16, ratio=2.0)
    pool = make_host_pool(shape)
    storage: HiCachedStorage = storages.make(
        pool, model=unique_model(), transport="bytes", host_bytes=64 << 20
    )
    assert storage.links["kv"].binding.geometry.page_bytes == 1 << 20
    keys = sglang_keys(n, 16)
    src, dst = pool.alloc(n * 16), pool.alloc(n * 16)
    randomize(pool, seed=12)
    assert storage.batch_set_v1(keys, src) == [True] * n
    assert storage.batch_get_v1(keys, dst) == [True] * n
    assert page_bits(pool, dst) == page_bits(pool, src)


def test_the_byte_path_keeps_to_a_daemons_lower_answer_limit_and_stores_only_readable_pages() -> None:
    """Fails before: with the daemon's limits.max_response_bytes below the adapter's batch,
    every byte-path read was refused whole (all misses), and a page larger than one answer
    was stored and found but could never be read. Now the adapter halves its batches when an
    answer is refused for its size, and PutBytes refuses a page no GetBytes could answer."""
    d = start_daemon("--set", "limits.max_response_bytes=768KiB")
    factory = StorageFactory(d.target)
    try:
        # 512 KiB pages: one per answer fits, 16 (the adapter's batch of 8 MiB) do not.
        small = make_host_pool(PoolShape(layers=16, heads=8, head_dim=128, page_size=8, device_tokens=20 * 8))
        storage: HiCachedStorage = factory.make(
            small, model=unique_model(), transport="bytes", host_bytes=16 << 20
        )
        keys = sglang_keys(6, 8)
        src, dst = small.alloc(6 * 8), small.alloc(6 * 8)
        randomize(small, seed=13)
        assert storage.batch_set_v1(keys, src) == [True] * 6
        assert storage.batch_get_v1(keys, dst) == [True] * 6
        assert page_bits(small, dst) == page_bits(small, src)
        # 1 MiB pages: over one answer, so not stored at all (and not found).
        large = make_host_pool(
            PoolShape(layers=16, heads=8, head_dim=128, page_size=16, device_tokens=8 * 16)
        )
        refused: HiCachedStorage = factory.make(
            large, model=unique_model(), transport="bytes", host_bytes=16 << 20
        )
        big = sglang_keys(2, 16)
        assert refused.batch_set_v1(big, large.alloc(2 * 16)) == [False, False]
        assert refused.batch_exists(big) == 0
    finally:
        factory.close_all()
        d.stop()


def test_a_daemon_outage_reads_as_misses_and_failed_writes() -> None:
    d = start_daemon()
    factory = StorageFactory(d.target)
    try:
        pool = make_host_pool(PoolShape())
        storage: HiCachedStorage = factory.make(pool, model=unique_model(), timeout_s=2.0)
        keys = sglang_keys(2, 4)
        assert storage.batch_set_v1(keys, pool.alloc(8)) == [True, True]
        d.stop()
        assert storage.batch_set_v1(sglang_keys(2, 4, first=99), pool.alloc(8)) == [False, False]
        assert storage.batch_get_v1(keys, pool.alloc(8)) == [False, False]
        assert storage.batch_exists(keys) == 0
        assert storage.get(keys[0]) is None
        assert storage.batch_set(keys, [pool.get_dummy_flat_data_page()] * 2) is False
    finally:
        factory.close_all()
        d.stop()


def test_a_lost_session_is_attached_again(daemon: Daemon, storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape())
    storage: HiCachedStorage = storages.make(pool, model=unique_model())
    keys = sglang_keys(4, 4)
    src = pool.alloc(16)
    assert storage.batch_set_v1(keys[:2], src[:8]) == [True, True]
    lost = storage.links["kv"].session.session_id
    with HiCacheClient(daemon.target) as client:
        secret = storage.links["kv"].session.info.session_secret
        client.session(lost, session_secret=secret).detach()  # as a daemon restart or an expired lease would
    assert storage.batch_set_v1(keys[2:], src[8:]) == [True, True]
    assert storage.links["kv"].session.session_id != lost
    dst = pool.alloc(16)
    # The model's pool group (and its pages) outlived the session.
    assert storage.batch_get_v1(keys, dst) == [True] * 4
    assert page_bits(pool, dst) == page_bits(pool, src)


def test_pages_survive_a_restart_of_sglang(daemon: Daemon, storages: StorageFactory) -> None:
    model = unique_model()
    keys = sglang_keys(3, 4)
    first = make_host_pool(PoolShape(layout="page_first"))
    src = first.alloc(12)
    storages.make(first, model=model).batch_set_v1(keys, src)
    storages.close_all()  # the server goes away (its sessions detach)
    second = make_host_pool(PoolShape(layout="page_first"))
    restarted = storages.make(second, model=model)
    dst = second.alloc(12)
    assert restarted.batch_get_v1(keys, dst) == [True] * 3
    assert page_bits(second, dst) == page_bits(first, src)
