"""Page write/load throughput of the copy engine beside a plain page gather (same run, same pages).

The device pool is a real shared-memory "device" pool exported by a worker helper and
opened through :class:`~hicached.transfer.DeviceMappings`; the host pool is a real
layer_first L2 pool. One page = 2 layers x K/V x 16 tokens x 4 heads x 128 dims x bf16
= 64 KiB. Device pages are random, host pages a contiguous range (what a fresh host
allocator hands out). ``engine_memcpy_gbps`` is the machine's limit for the same work: one
``index_select`` of the same random 64 KiB pages into a preallocated buffer.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch
from hicached_client.export import ShmKVPool, dtype_from_wire
from hicached_client.v1 import types_pb2

from hicached.l2.host_pool import create_host_pool
from hicached.l2.layout import HostLayout, KVSpec, PoolKind
from hicached.transfer import (
    BufferSpec,
    CopyEngine,
    DeviceMappings,
    DevicePoolView,
    Direction,
    FdBufferHandle,
    Medium,
    Priority,
    build_plan,
)

PAGES = 1000
DEVICE_PAGES = 2 * PAGES
SPEC = KVSpec(kind=PoolKind.MHA, dtype=torch.bfloat16, num_layers=2, num_heads=4, head_dim=128, page_size=16)


def _interleaved_medians(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds of each fn, measured in alternating rounds so that all see the same load."""
    for fn in fns.values():
        fn()  # warm-up: first touch of mappings and staging buffers
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _open_device_pool(pool: ShmKVPool, mappings: DeviceMappings) -> DevicePoolView:
    def spec_of(buf: types_pb2.DeviceBuffer) -> BufferSpec:
        fd = buf.handle.fd  # in-process: fd_index is this process's own fd (see export_fd_tensor)
        handle = FdBufferHandle(fd=fd.fd_index, offset=fd.offset, size=fd.size)
        return BufferSpec(handle=handle, shape=tuple(buf.shape), dtype=dtype_from_wire(buf.dtype))

    ks = pool.k_buffers()
    # All at once, as an attach does: one mapping over the span of every buffer.
    views = mappings.open_all([spec_of(b) for b in (*ks, *pool.v_buffers())])
    return DevicePoolView(
        name="kv",
        k=views[: len(ks)],
        v=views[len(ks) :],
        page_size=SPEC.page_size,
        layer_ids=list(range(SPEC.num_layers)),
        medium=Medium.CPU,
    )


def run(quick: bool) -> dict[str, float]:
    """Throughputs in GB/s (1e9 bytes/s) and their ratios to ``engine_memcpy_gbps``."""
    reps = 5 if quick else 21
    tag = f"hicached-bench-copy-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(1234)
    device_pages = rng.permutation(DEVICE_PAGES)[:PAGES].astype(np.int64)
    host_pages = np.arange(PAGES, dtype=np.int64)
    nbytes = PAGES * SPEC.page_bytes

    # The machine's limit: gather the same random pages in one index op.
    words = SPEC.page_bytes // 8
    flat_src = torch.ones(DEVICE_PAGES, words, dtype=torch.int64)
    flat_dst = torch.zeros(PAGES, words, dtype=torch.int64)
    idx = torch.from_numpy(device_pages)

    device = ShmKVPool(
        f"{tag}-dev",
        num_layers=SPEC.num_layers,
        tokens=DEVICE_PAGES * SPEC.page_size,
        heads=SPEC.num_heads,
        head_dim=SPEC.head_dim,
        dtype=SPEC.dtype,
    )
    host = create_host_pool(SPEC, HostLayout.LAYER_FIRST, PAGES, segment_name=f"{tag}-host")
    mappings = DeviceMappings()
    engine = CopyEngine(workers=2)
    try:
        for t in (*device.k, *device.v):
            t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16))
        items = [(_open_device_pool(device, mappings), host, device_pages, host_pages)]

        def gather() -> None:
            torch.index_select(flat_src, 0, idx, out=flat_dst)

        def write() -> None:
            plan = build_plan(Direction.D2H, items)
            engine.submit(plan, priority=Priority.WRITE_BACK, owner="bench").result()

        def load() -> None:
            plan = build_plan(Direction.H2D, items)
            engine.submit(plan, priority=Priority.DEMAND, owner="bench").result()

        seconds = _interleaved_medians({"memcpy": gather, "d2h": write, "h2d": load}, reps)
        items.clear()
    finally:
        engine.close()
        mappings.close()
        device.close()
        device.unlink()
        host.close()
        host.unlink()

    memcpy = nbytes / seconds["memcpy"] / 1e9
    d2h = nbytes / seconds["d2h"] / 1e9
    h2d = nbytes / seconds["h2d"] / 1e9
    return {
        "engine_pages": float(PAGES),
        "engine_page_kib": SPEC.page_bytes / 1024,
        "engine_memcpy_gbps": memcpy,
        "engine_d2h_gbps": d2h,
        "engine_h2d_gbps": h2d,
        "d2h_vs_memcpy": d2h / memcpy,
        "h2d_vs_memcpy": h2d / memcpy,
    }
