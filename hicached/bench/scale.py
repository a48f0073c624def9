"""Scale table: does the cost per unit of work stay flat as the work grows? (issue 13, item 4)

Every row is measured in this run, beside its own floor where one exists:

* ``scale_{write,load}_us_per_page_p{N}``: one copy-engine D2H / H2D of N random 64 KiB
  pages (no gRPC: the daemon's per-call fixed cost is the ``daemon`` suite's figure), in
  microseconds per page, beside ``scale_memcpy_us_per_page_p{N}`` (one ``index_select`` of
  the same pages into a preallocated buffer: the machine's limit);
* ``scale_{lookup,publish}_us_per_key_k{N}``: a 128-key batch looked up / published on a
  :class:`~hicached.index.ContentIndex` that already holds N keys, microseconds per key;
* ``scale_pool_create_s_g{G}`` / ``scale_pool_create_gbps_g{G}``: reserving and prefaulting
  a G GiB host pool in ``/dev/shm``; ``scale_pool_alloc_us_g{G}``: one alloc + free of 128
  pages on that pool (the allocator's per-op cost must not grow with the pool);
* ``scale_workers_gbps_w{W}`` / ``scale_workers_p99_ms_w{W}``: W threads, each its own
  128-page D2H stream, submitting to one shared copy engine at once: aggregate GB/s and the
  p99 latency of one submission (in-process workers: the engine's sharing, not gRPC's);
(The machine's raw IPC limit, ``uds_pingpong_us``, is measured by the ``fastlane`` suite.)

Sizes are capped by what a shared 2-core, 24 GiB machine does quickly; ``scale_caps`` in the
notes says where the caps are. ``--quick`` runs the small end of every row.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch
from hicached_client.export import ShmKVPool

from hicached.bench.copy import SPEC, _open_device_pool
from hicached.bench.keyed import TINY_SPEC
from hicached.index import ContentIndex
from hicached.l2 import HostLayout, HostPoolGroup, PoolEntry, create_host_pool
from hicached.l2.host_pool import HostKVPool
from hicached.transfer import CopyEngine, DeviceMappings, DevicePoolView, Direction, Priority, build_plan

__all__ = ["run"]

log = logging.getLogger(__name__)

GIB = 1 << 30
BATCH = 128


def _tag(what: str) -> str:
    return f"hicached-bench-scale-{os.getpid()}-{uuid.uuid4().hex[:8]}-{what}"


def _median_s(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copies(sizes: tuple[int, ...], workers: tuple[int, ...], reps: int) -> dict[str, float]:
    """Per-page copy cost for each call size, then W concurrent submitters."""
    biggest = max(*sizes, BATCH * max(workers))
    device_pages = 2 * biggest
    device = ShmKVPool(
        _tag("dev"),
        num_layers=SPEC.num_layers,
        tokens=device_pages * SPEC.page_size,
        heads=SPEC.num_heads,
        head_dim=SPEC.head_dim,
        dtype=SPEC.dtype,
    )
    host = create_host_pool(SPEC, HostLayout.LAYER_FIRST, biggest, segment_name=_tag("host"), pin=False)
    mappings = DeviceMappings()
    engine = CopyEngine(workers=2)
    rng = np.random.default_rng(7)
    words = SPEC.page_bytes // 8
    out: dict[str, float] = {}
    try:
        view = _open_device_pool(device, mappings)
        flat_src = torch.ones(device_pages, words, dtype=torch.int64)
        for n in sizes:
            out.update(_per_page(engine, view, host, flat_src, n, rng, reps))
        for w in workers:
            out.update(_concurrent(engine, view, host, w, rng, reps, device_pages))
    finally:
        engine.close()
        mappings.close()
        device.close()
        device.unlink()
        host.close()
        host.unlink()
    return out


def _per_page(
    engine: CopyEngine,
    view: DevicePoolView,
    host: HostKVPool,
    flat_src: torch.Tensor,
    n: int,
    rng: np.random.Generator,
    reps: int,
) -> dict[str, float]:
    """Median cost per page of one call of ``n`` pages: gather floor, D2H, H2D."""
    dev = rng.permutation(flat_src.shape[0])[:n].astype(np.int64)
    items = [(view, host, dev, np.arange(n, dtype=np.int64))]
    flat_dst = torch.zeros(n, flat_src.shape[1], dtype=torch.int64)
    idx = torch.from_numpy(dev)

    def gather() -> None:
        torch.index_select(flat_src, 0, idx, out=flat_dst)

    def write() -> None:
        engine.submit(build_plan(Direction.D2H, items), priority=Priority.WRITE_BACK, owner="b").result()

    def load() -> None:
        engine.submit(build_plan(Direction.H2D, items), priority=Priority.DEMAND, owner="b").result()

    rounds = max(3, min(reps * 10, 10_000 // n))  # small calls: more rounds, same total work
    out = {}
    for name, fn in (("memcpy", gather), ("write", write), ("load", load)):
        fn()  # warm: first touch of this call's pages
        out[f"scale_{name}_us_per_page_p{n}"] = _median_s(fn, rounds) / n * 1e6
    return out


def _concurrent(
    engine: CopyEngine,
    view: DevicePoolView,
    host: HostKVPool,
    w: int,
    rng: np.random.Generator,
    reps: int,
    device_pages: int,
) -> dict[str, float]:
    rounds = max(4, reps * 2)
    streams = [
        [
            (
                view,
                host,
                rng.permutation(device_pages)[:BATCH].astype(np.int64),
                np.arange(i * BATCH, (i + 1) * BATCH),
            )
        ]
        for i in range(w)
    ]
    latencies: list[float] = []
    lock = threading.Lock()
    start_gate = threading.Barrier(w + 1)

    def worker(items: list[object]) -> None:
        mine = []
        start_gate.wait()
        for _ in range(rounds):
            t0 = time.perf_counter()
            plan = build_plan(Direction.D2H, items)  # type: ignore[arg-type]
            engine.submit(plan, priority=Priority.WRITE_BACK, owner="b").result()
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    start_gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    nbytes = w * rounds * BATCH * SPEC.page_bytes
    return {
        f"scale_workers_gbps_w{w}": nbytes / elapsed / 1e9,
        f"scale_workers_p99_ms_w{w}": float(np.percentile(latencies, 99)) * 1e3,
    }


def _index(sizes: tuple[int, ...], probes: int) -> dict[str, float]:
    """One index grown to each size in turn; at each size, time fresh 128-key batches."""
    total = max(sizes) + 2 * probes * BATCH * len(sizes)
    out: dict[str, float] = {}
    name = _tag("index")
    pool = create_host_pool(TINY_SPEC, HostLayout.PAGE_FIRST, total, segment_name=name, pin=False)
    group = HostPoolGroup([PoolEntry("kv", pool, is_primary_index_anchor=True)])
    index = ContentIndex(group, namespace="scale", backend=None)
    allocator = pool.allocator
    held = 0
    serial = 0

    def publish(n: int) -> list[str]:
        nonlocal serial
        keys = [f"s{serial + i:010x}" for i in range(n)]
        serial += n
        pages = allocator.alloc(n)
        assert pages is not None
        index.publish(keys, {"kv": pages})
        return keys

    try:
        for size in sizes:
            while held < size:
                step = min(BATCH * 64, size - held)
                publish(step)
                held += step
            pub, look = [], []
            for _ in range(probes):
                t0 = time.perf_counter()
                keys = publish(BATCH)
                pub.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                index.lookup(keys)
                look.append(time.perf_counter() - t0)
            held += probes * BATCH
            out[f"scale_publish_us_per_key_k{size}"] = statistics.median(pub) / BATCH * 1e6
            out[f"scale_lookup_us_per_key_k{size}"] = statistics.median(look) / BATCH * 1e6
    finally:
        index.close()
        pool.close()
        pool.unlink()
    return out


def _pools(gibs: tuple[float, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for gib in gibs:
        pages = int(gib * GIB) // SPEC.page_bytes
        start = time.perf_counter()
        pool = create_host_pool(SPEC, HostLayout.LAYER_FIRST, pages, segment_name=_tag("pool"), pin=False)
        created = time.perf_counter() - start
        try:
            key = f"g{gib:g}"
            out[f"scale_pool_create_s_{key}"] = created
            out[f"scale_pool_create_gbps_{key}"] = pages * SPEC.page_bytes / created / 1e9
            out[f"scale_pool_alloc_us_{key}"] = _alloc_free_us(pool)
        finally:
            pool.close()
            pool.unlink()
    return out


def _alloc_free_us(pool: HostKVPool) -> float:
    allocator = pool.allocator

    def op() -> None:
        got = allocator.alloc(BATCH)
        assert got is not None
        allocator.free(got)

    return _median_s(op, 200) * 1e6


def run(quick: bool) -> dict[str, float]:
    """The scale table as flat figures (see the module docstring for the keys)."""
    page_sizes: tuple[int, ...]
    workers: tuple[int, ...]
    keys: tuple[int, ...]
    gibs: tuple[float, ...]
    if quick:
        page_sizes, workers, keys, gibs, reps = (10, 100, 1000), (1, 2, 4), (1000, 10_000), (0.25, 0.5), 3
    else:
        page_sizes, workers, keys, reps = (
            (10, 100, 1000, 10_000),
            (1, 2, 4, 8),
            (1000, 10_000, 100_000, 1_000_000),
            7,
        )
        # Capped at 4 GiB: /dev/shm and RAM are shared with other tenants of the machine.
        free_gib = shutil.disk_usage("/dev/shm").free / GIB
        gibs = tuple(g for g in (1.0, 2.0, 4.0) if g <= free_gib / 2)
        if len(gibs) < 3:
            log.warning("host pools capped at %s GiB: /dev/shm has %.1f GiB free", gibs[-1:], free_gib)
    out = _copies(page_sizes, workers, reps)
    out.update(_index(keys, probes=max(5, reps * 3)))
    out.update(_pools(gibs))
    return out
