"""SGLang L3 through the daemon vs SGLang's own ``HiCacheFile``, measured in one run.

Both backends are built by SGLang 0.5.23's ``StorageBackendFactory`` over the
same real ``MHATokenToKVPoolHost`` (CPU, ``layer_first``, 64 KiB pages: K and V
of 8 layers x 8 heads x 64 dims x 4 tokens in fp16) and move the same pages in
SGLang's batches of 128, the way its cache controller calls them:

* ``hicached_set_gbps`` / ``hicached_get_gbps``: ``HiCachedStorage.batch_set_v1``
  / ``batch_get_v1`` (host pool -> shared staging -> daemon L2 and back), against
  a ``hicached serve`` subprocess on a Unix socket.
* ``hicached_bytes_set_gbps`` / ``hicached_bytes_get_gbps``: the same with
  ``transport: bytes`` (page bytes inside gRPC messages), the fallback.
* ``hicachefile_set_gbps`` / ``hicachefile_get_gbps``: ``HiCacheFile.batch_set``
  / ``batch_get`` of flat data pages (SGLang's generic page path for the file
  backend: one file per page) in a temporary directory.
* ``set_ratio`` / ``get_ratio``: hicached over HiCacheFile (higher is better).
* ``hicached_zc_set_gbps`` / ``hicached_zc_get_gbps``: the zero-copy path (a
  ``page_first`` pool from SGLang's ``shm`` allocator, its memfd sealed; the
  daemon copies to and from the host pool itself), and
  ``hicachefile_pf_set_gbps`` / ``hicachefile_pf_get_gbps``: HiCacheFile on that
  same pool; ``sglang_set_vs_file`` / ``sglang_get_vs_file``: the former over the
  latter (higher is better).
* ``sglang_memcpy_gbps``: one contiguous copy of the same bytes, the machine's limit.

Reads are checked byte-exact (a mismatch raises). GB/s are 10**9 bytes per
second. Needs SGLang installed (the ``sglang`` extra of the client); nothing
is printed.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
from hicached_client.sglang.cpu_compat import ensure_sglang_importable

from hicached.bench import SuiteSkipped, missing_package
from hicached.bench.daemon import running_daemon
from hicached.bench.timing import gbps, timed

__all__ = ["run"]

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
LAYERS, HEADS, HEAD_DIM, PAGE_SIZE = 8, 8, 64, 4
DTYPE = torch.float16
PAGE_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * PAGE_SIZE * DTYPE.itemsize  # 64 KiB


def _host_pool(num_pages: int, layout: str = "layer_first", allocator: str = "default") -> Any:
    from sglang.srt.mem_cache.device_pool_info import (  # type: ignore[import-untyped]
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # type: ignore[import-untyped]

    # Device buffers are only described (their pointers), never copied here.
    k = tuple(torch.empty(PAGE_SIZE, HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))
    v = tuple(torch.empty(PAGE_SIZE, HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))

    def ptrs(bufs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE_SIZE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    # Room for the pages written and a second copy read back.
    tokens = 2 * num_pages * PAGE_SIZE
    pool = MHATokenToKVPoolHost(
        info,
        1.0,
        0,
        PAGE_SIZE,
        layout,
        pin_memory=False,
        allocator_type=allocator,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=LAYERS,
    )
    bits = pool.kv_buffer.view(torch.int16)
    bits.copy_(torch.randint(-(2**15), 2**15, bits.shape, dtype=torch.int16))
    return pool


def _storage_config(model: str, extra: dict[str, Any], page_first: bool = False) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # type: ignore[import-untyped]

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=extra,
    )


def _batches(n: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + BATCH, n)) for lo in range(0, n, BATCH)]


def _hicached(
    pool: Any, target: str, keys: list[str], src: torch.Tensor, transport: str, zero_copy: bool = False
) -> tuple[float, float]:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # type: ignore[import-untyped]

    extra = {
        "backend_name": "hicached",
        "module_path": "hicached_client.sglang",
        "class_name": "HiCachedStorage",
        "interface_v1": 1,
        "hicached": {
            "target": target,
            "transport": transport,
            "staging_pages": BATCH,
            "host_bytes": (len(keys) + BATCH) * PAGE_BYTES,
        },
    }
    page_first = pool.layout != "layer_first"
    storage = StorageBackendFactory.create_backend(
        "dynamic", _storage_config(f"bench/{transport}-{uuid.uuid4().hex[:8]}", extra, page_first), pool
    )
    storage.register_mem_pool_host(pool)
    path = storage.links["kv"].path
    if (path == "zero-copy") != zero_copy:
        storage.close()
        raise RuntimeError(f"hicached chose the {path} path, the bench asked for zero_copy={zero_copy}")
    n = len(keys)
    dst = pool.alloc(n * PAGE_SIZE)
    try:

        def put() -> None:
            for lo, hi in _batches(n):
                if not all(storage.batch_set_v1(keys[lo:hi], src[lo * PAGE_SIZE : hi * PAGE_SIZE])):
                    raise RuntimeError("hicached batch_set_v1 failed")

        def get() -> None:
            for lo, hi in _batches(n):
                if not all(storage.batch_get_v1(keys[lo:hi], dst[lo * PAGE_SIZE : hi * PAGE_SIZE])):
                    raise RuntimeError("hicached batch_get_v1 missed")

        t_set, t_get = timed(put), timed(get)
        _check_same(pool, src, dst)
        return t_set, t_get
    finally:
        pool.free(dst)
        storage.close()


def _hicachefile(pool: Any, keys: list[str], src: torch.Tensor, directory: Path) -> tuple[float, float]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # type: ignore[import-untyped]

    extra = {"file_storage_path": str(directory), "enable_metadata_cache": False}
    storage = HiCacheFile(_storage_config("bench/file", extra, pool.layout != "layer_first"))
    n = len(keys)
    dst = pool.alloc(n * PAGE_SIZE)
    try:
        # SGLang's generic page path (cache_controller._generic_page_set/_get).
        def put() -> None:
            for lo, hi in _batches(n):
                data = [pool.get_data_page(int(src[i * PAGE_SIZE])) for i in range(lo, hi)]
                if not storage.batch_set(keys[lo:hi], data):
                    raise RuntimeError("HiCacheFile batch_set failed")

        def get() -> None:
            for lo, hi in _batches(n):
                targets = [pool.get_dummy_flat_data_page() for _ in range(lo, hi)]
                pages = storage.batch_get(keys[lo:hi], targets)
                for i, page in zip(range(lo, hi), pages, strict=True):
                    if page is None:
                        raise RuntimeError("HiCacheFile batch_get missed")
                    pool.set_from_flat_data_page(int(dst[i * PAGE_SIZE]), page)

        t_set, t_get = timed(put), timed(get)
        _check_same(pool, src, dst)
        return t_set, t_get
    finally:
        pool.free(dst)


def _check_same(pool: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
    for a, b in zip(src[::PAGE_SIZE].tolist(), dst[::PAGE_SIZE].tolist(), strict=True):
        if not torch.equal(pool.get_data_page(a).view(torch.int16), pool.get_data_page(b).view(torch.int16)):
            raise RuntimeError(f"page read back from host slot {b} differs from slot {a}")


def _memcpygbps(nbytes: int) -> float:
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    b.copy_(a)  # warm
    return gbps(nbytes, min(timed(lambda: b.copy_(a)) for _ in range(3)))


def run(quick: bool) -> dict[str, float]:
    """Throughput of SGLang's storage calls through the daemon vs HiCacheFile (GB/s, ratios)."""
    why_not = missing_package("sglang") or missing_package("transformers")
    if why_not:
        raise SuiteSkipped(why_not)
    ensure_sglang_importable()
    num_pages = 256 if quick else 2000
    nbytes = num_pages * PAGE_BYTES
    pool = _host_pool(num_pages)
    src = pool.alloc(num_pages * PAGE_SIZE)
    keys = [f"bench{uuid.uuid4().hex[:8]}{i:06d}" for i in range(num_pages)]
    workdir = Path(tempfile.mkdtemp(prefix="hicached-bench-sglang-"))
    try:
        budget = f"{max(256, 3 * nbytes >> 20)}MiB"
        with running_daemon(workdir, host_budget=budget, l3="none") as target:
            h_set, h_get = _hicached(pool, target, keys, src, "shm")
            b_set, b_get = _hicached(pool, target, keys, src, "bytes")
        f_set, f_get = _hicachefile(pool, keys, src, workdir / "file")
        del pool, src
        # Zero-copy: SGLang's shm allocator (sealed), page_first; HiCacheFile on the same pool.
        zc_pool, zc_src = _sealed_shm_pool(num_pages)
        zc_keys = [f"benchzc{uuid.uuid4().hex[:8]}{i:06d}" for i in range(num_pages)]
        (workdir / "zc").mkdir()
        with running_daemon(workdir / "zc", host_budget=budget, l3="none") as target:
            z_set, z_get = _hicached(zc_pool, target, zc_keys, zc_src, "shm", zero_copy=True)
        zf_set, zf_get = _hicachefile(zc_pool, zc_keys, zc_src, workdir / "zcfile")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results = {
        "sglang_pages": float(num_pages),
        "sglang_page_bytes": float(PAGE_BYTES),
        "hicached_set_gbps": gbps(nbytes, h_set),
        "hicached_get_gbps": gbps(nbytes, h_get),
        "hicached_bytes_set_gbps": gbps(nbytes, b_set),
        "hicached_bytes_get_gbps": gbps(nbytes, b_get),
        "hicachefile_set_gbps": gbps(nbytes, f_set),
        "hicachefile_get_gbps": gbps(nbytes, f_get),
        "sglang_memcpy_gbps": _memcpygbps(nbytes),
    }
    results["set_ratio"] = f_set / h_set if h_set > 0 else 0.0
    results["get_ratio"] = f_get / h_get if h_get > 0 else 0.0
    results["hicached_zc_set_gbps"] = gbps(nbytes, z_set)
    results["hicached_zc_get_gbps"] = gbps(nbytes, z_get)
    results["hicachefile_pf_set_gbps"] = gbps(nbytes, zf_set)
    results["hicachefile_pf_get_gbps"] = gbps(nbytes, zf_get)
    # Zero-copy hicached over HiCacheFile on the same page_first shm pool (higher is better).
    results["sglang_set_vs_file"] = zf_set / z_set if z_set > 0 else 0.0
    results["sglang_get_vs_file"] = zf_get / z_get if z_get > 0 else 0.0
    return results


def _sealed_shm_pool(num_pages: int) -> tuple[Any, torch.Tensor]:
    """A page_first pool from SGLang's shm allocator, its memfd sealed (as the client's plugin does)."""
    import sglang.srt.mem_cache.storage.mmap as sgl_mmap  # type: ignore[import-untyped]
    from hicached_client.sglang.zerocopy import install_sealed_shm

    original = sgl_mmap.alloc_shm
    install_sealed_shm()
    try:
        pool = _host_pool(num_pages, "page_first", "shm")
    finally:
        sgl_mmap.alloc_shm = original
    return pool, pool.alloc(num_pages * PAGE_SIZE)
