"""L2 host pools: creation cost, allocation and resolve cost, flat page copies -- beside the machine.

Pairs to compare (same run, same bytes):

* ``pool_create_s`` (reserve + prefault a ``pool_create_gib`` GiB pool in
  ``/dev/shm``) vs ``memset_fresh_s`` (``memset`` of the same number of fresh
  anonymous bytes: the first-touch floor) and ``memset_warm_s`` (the same
  memset again, pages already mapped: the memory-bandwidth floor);
* ``pool_memcpy_gbps``: a warm copy of ``memcpy_gib`` GiB, the machine's copy limit,
  vs ``get_page_flat_gbps`` (a fresh 2 MiB result per page),
  ``get_page_flat_out_gbps`` (into a reused buffer) and ``set_page_flat_gbps``
  (one page at a time, layer_first, i.e. 16 extents per page);
* ``alloc_10k_pages_ms`` (one ``alloc(10000)``), ``alloc_1_page_us`` (one
  page per call), ``resolve_10k_pages_ms`` (one ``resolve_all`` over an anchor
  and two sidecars, 10,000 pages in all, plus a derived pool) and
  ``resolve_10k_pages_100_batches_ms`` (the same pages as 100 resolves of 100,
  one per scheduler step), each with its ``release``; ``numpy_arange_10k_us``
  is the floor for producing 10,000 indices at all.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from hicached.l2.allocator import PageAllocator
from hicached.l2.group import HostPoolGroup, PoolEntry, PoolTransfer
from hicached.l2.host_pool import HostKVPool, create_host_pool
from hicached.l2.layout import HostLayout, KVSpec, PoolKind

GIB = 1 << 30
RESOLVE_PAGES = 10_000
# 2 MiB pages: bf16, 8 layers, K/V, 8 heads x 128 dims, 64 tokens.
BIG_SPEC = KVSpec(PoolKind.MHA, torch.bfloat16, num_layers=8, num_heads=8, head_dim=128, page_size=64)
# Data-free pools for allocation timing: what is measured is bookkeeping, not bytes.
TINY_SPEC = KVSpec(PoolKind.MHA, torch.uint8, num_layers=1, num_heads=1, head_dim=1, page_size=1)


def _name(what: str) -> str:
    return f"hicached-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}-{what}"


def _best(fn: Callable[[], object], reps: int) -> float:
    """Fastest of ``reps`` runs, in seconds (the least disturbed by a shared VM)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _creation(gib: int, reps: int) -> dict[str, float]:
    """Best of ``reps`` rounds, each a pool creation then a fresh memset of the same bytes."""
    pages = gib * GIB // BIG_SPEC.page_bytes - 1
    nbytes = HostKVPool.required_bytes(BIG_SPEC, HostLayout.LAYER_FIRST, pages)
    created, fresh, warm = [], [], []
    copies: dict[str, float] = {}
    for rep in range(reps):
        start = time.perf_counter()
        pool = create_host_pool(
            BIG_SPEC, HostLayout.LAYER_FIRST, pages, segment_name=_name("create"), pin=False
        )
        created.append(time.perf_counter() - start)
        try:
            if rep == reps - 1:
                copies = _page_copies(pool)
        finally:
            pool.close()
            pool.unlink()
        first, again = _memset(nbytes)
        fresh.append(first)
        warm.append(again)
    return {
        "pool_create_gib": float(gib),
        "pool_create_s": min(created),
        "pool_create_gbps": nbytes / min(created) / 1e9,
        "memset_fresh_s": min(fresh),
        "memset_warm_s": min(warm),
        **copies,
    }


def _memset(nbytes: int) -> tuple[float, float]:
    """Seconds to memset ``nbytes`` of fresh (never touched) memory, then the same bytes again."""
    buf = np.empty(nbytes, dtype=np.uint8)
    start = time.perf_counter()
    buf.fill(0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    buf.fill(1)
    return first, time.perf_counter() - start


def _page_copies(pool: HostKVPool) -> dict[str, float]:
    n = min(256, pool.num_pages)
    nbytes = n * pool.page_bytes
    page = pool.get_page_flat(0)

    def get_all() -> None:
        for p in range(n):
            pool.get_page_flat(p)

    def get_all_into() -> None:
        for p in range(n):
            pool.get_page_flat(p, out=page)

    def set_all() -> None:
        for p in range(n):
            pool.set_page_flat(p, page)

    return {
        "get_page_flat_gbps": nbytes / _best(get_all, reps=3) / 1e9,
        "get_page_flat_out_gbps": nbytes / _best(get_all_into, reps=3) / 1e9,
        "set_page_flat_gbps": nbytes / _best(set_all, reps=3) / 1e9,
    }


def _memcpy(gib: float) -> dict[str, float]:
    nbytes = int(gib * GIB)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    seconds = _best(lambda: np.copyto(dst, src), reps=3)
    return {"memcpy_gib": gib, "pool_memcpy_gbps": nbytes / seconds / 1e9}


def _allocation(reps: int) -> dict[str, float]:
    alloc = PageAllocator(2 * RESOLVE_PAGES)

    def bulk() -> None:
        pages = alloc.alloc(RESOLVE_PAGES)
        assert pages is not None
        alloc.free(pages)

    def one_by_one() -> None:
        held = [alloc.alloc(1) for _ in range(1000)]
        for pages in held:
            assert pages is not None
            alloc.free(pages)

    return {
        "alloc_10k_pages_ms": _best(bulk, reps) * 1e3,
        "alloc_1_page_us": _best(one_by_one, reps) / 1000 * 1e6,
        "numpy_arange_10k_us": _best(lambda: np.arange(RESOLVE_PAGES, dtype=np.int64), reps * 10) * 1e6,
    }


def _resolve(reps: int) -> dict[str, float]:
    capacity = RESOLVE_PAGES + 1
    pools = {
        name: create_host_pool(
            TINY_SPEC, HostLayout.PAGE_FIRST, capacity, segment_name=_name(name), pin=False
        )
        for name in ("kv", "swa", "mamba", "draft")
    }
    try:
        group = HostPoolGroup(
            [
                PoolEntry("kv", pools["kv"], is_primary_index_anchor=True),
                PoolEntry("swa", pools["swa"]),
                PoolEntry("mamba", pools["mamba"]),
                PoolEntry("draft", pools["draft"], indices_from_pool="kv"),
            ]
        )
        share = {"kv": 3334, "swa": 3333, "mamba": 3333}

        def transfers(scale: float) -> list[PoolTransfer]:
            out = [PoolTransfer(n, np.arange(int(k * scale), dtype=np.int64)) for n, k in share.items()]
            return [*out, PoolTransfer("draft")]

        def once() -> None:
            result = group.resolve_all(transfers(1.0))
            assert result.ok, result.reason
            group.release_transfers(result.transfers)

        def batched() -> None:
            step = transfers(0.01)  # 34 + 33 + 33 = 100 pages
            results = [group.resolve_all(step) for _ in range(100)]
            assert all(r.ok for r in results)
            for r in results:
                group.release_transfers(r.transfers)

        return {
            "resolve_10k_pages_ms": _best(once, reps) * 1e3,
            "resolve_10k_pages_100_batches_ms": _best(batched, reps) * 1e3,
        }
    finally:
        for pool in pools.values():
            pool.close()
            pool.unlink()


def run(quick: bool) -> dict[str, float]:
    """The figures above; ``quick`` creates a 1 GiB pool instead of 4 GiB and repeats less."""
    reps = 3 if quick else 7
    results: dict[str, float] = {}
    results.update(_allocation(reps))
    results.update(_resolve(reps))
    results.update(_creation(1 if quick else 4, reps=1 if quick else 2))
    results.update(_memcpy(0.25 if quick else 1.0))
    return results
