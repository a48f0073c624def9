"""SGLang L3 through the daemon vs SGLang's own ``HiCacheFile``, like for like, in one run.

Both backends move the same pages of one real SGLang host pool: a
``page_first`` ``MHATokenToKVPoolHost`` from SGLang's ``shm`` allocator (its
memfd sealed as the client's plugin does, so the adapter takes the zero-copy
path: the daemon maps SGLang's host pool and copies pages itself; the bench
raises if it did not), K and V of 8 layers x 8 heads x 64 dims in fp16 --
4-token pages of 64 KiB, and with the ``_1m`` suffix 64-token pages of 1 MiB.
Each backend is called as SGLang 0.5.23's cache controller calls it, in
batches of 128: ``HiCachedStorage.batch_set_v1`` / ``batch_get_v1`` (built by
SGLang's ``StorageBackendFactory``), and ``HiCacheFile.batch_set`` /
``batch_get`` of flat data pages (its generic page path: one file per page).
A get is a prefetch as the controller runs it: ``batch_exists`` of every batch
(its hit query), then the batches' gets; both are timed.

Per round (fresh keys, fresh directories), every figure in GB/s (10**9 B/s):

* ``sglang_disk_write_gbps`` / ``sglang_disk_cold_read_gbps``: the machine's
  limit, the same bytes written to one plain file in 128-page ``write`` calls up
  to an ``fdatasync``, then read back cold in 128-page ``readv`` calls.
* ``sglang_file_set_gbps``: HiCacheFile set; ``sglang_file_hot_get_gbps``: its
  get right after (page cache); ``sglang_file_cold_get_gbps``: its get after
  its files were evicted from the page cache.
* ``sglang_hicached_set_gbps``: set until durable, i.e. every page acknowledged
  by the daemon's file L3 (``batch_set_v1`` of every batch, then ``Backup`` with
  ``wait``), like HiCacheFile's set (neither fsyncs: both end in the page cache);
  ``sglang_hicached_warm_get_gbps``: get right after (an L2 hit);
  ``sglang_hicached_cold_get_gbps``: get from L3 after the daemon was restarted
  (a new process on the same L3 directory) and its L3 files were evicted.

"Evicted" is the same method everywhere: ``fdatasync`` then
``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file (``/proc/sys/vm/drop_caches``
needs root outside a container). The ratios ``sglang_set_vs_file``,
``sglang_cold_get_vs_file``, ``sglang_warm_get_vs_file`` (hicached warm vs
HiCacheFile hot) and ``sglang_cold_get_vs_disk`` are medians of the per-round
ratios; the GB/s figures are medians over rounds. Every read is checked byte
for byte (a mismatch raises). Needs SGLang installed (the client's ``sglang``
extra); nothing is printed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hicached_client.sglang.cpu_compat import ensure_sglang_importable

from hicached.bench import SuiteSkipped, missing_package
from hicached.bench.daemon import running_daemon
from hicached.bench.timing import drop_cache, gbps, timed

__all__ = ["run"]

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
LAYERS, HEADS, HEAD_DIM = 8, 8, 64
DTYPE = torch.float16
_PRIME = 1_000_003  # elements of the random block the pool is tiled with (2 MB)


@dataclass(frozen=True)
class Size:
    """One page size of the run: ``suffix`` names its figures."""

    suffix: str
    page_tokens: int
    pages: int

    @property
    def page_bytes(self) -> int:
        return 2 * LAYERS * HEADS * HEAD_DIM * self.page_tokens * DTYPE.itemsize

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes


def _host_pool(size: Size) -> Any:
    """A page_first pool from SGLang's shm allocator, its memfd sealed (as the client's plugin does)."""
    import sglang.srt.mem_cache.storage.mmap as sgl_mmap  # type: ignore[import-untyped]
    from hicached_client.sglang.zerocopy import install_sealed_shm
    from sglang.srt.mem_cache.device_pool_info import (  # type: ignore[import-untyped]
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # type: ignore[import-untyped]

    # Device buffers are only described (their pointers), never copied here.
    k = tuple(torch.empty(size.page_tokens, HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))
    v = tuple(torch.empty(size.page_tokens, HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))

    def ptrs(bufs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=size.page_tokens,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    original = sgl_mmap.alloc_shm
    install_sealed_shm()
    try:
        # Room for the pages written and a second copy read back.
        pool = MHATokenToKVPoolHost(
            info,
            1.0,
            0,
            size.page_tokens,
            "page_first",
            pin_memory=False,
            allocator_type="shm",
            device="cpu",
            device_capacity_tokens=2 * size.pages * size.page_tokens,
            start_layer=0,
            end_layer=LAYERS,
        )
    finally:
        sgl_mmap.alloc_shm = original
    _fill(pool.kv_buffer.view(torch.int16).reshape(-1))
    return pool


def _fill(flat: torch.Tensor) -> None:
    """Random bits, cheaply: one random block of a prime number of elements, tiled. No page size
    is a multiple of the prime, so every page of the pool differs from every other."""
    block = torch.randint(-(2**15), 2**15, (_PRIME,), dtype=torch.int16)
    whole = flat.numel() // _PRIME
    flat[: whole * _PRIME].view(whole, _PRIME).copy_(block.expand(whole, _PRIME))
    flat[whole * _PRIME :].copy_(block[: flat.numel() - whole * _PRIME])


def _storage_config(model: str, extra: dict[str, Any]) -> Any:
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
        is_page_first_layout=True,
        model_name=model,
        extra_config=extra,
    )


def _batches(n: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, BATCH):
        yield lo, min(lo + BATCH, n)


def _hit_query(storage: Any, keys: list[str]) -> None:
    """The controller's hit query before a prefetch (``_storage_hit_query``): ``batch_exists``
    batch by batch; every page must hit."""
    for lo, hi in _batches(len(keys)):
        if storage.batch_exists(keys[lo:hi]) != hi - lo:
            raise RuntimeError(f"{type(storage).__name__} batch_exists missed pages of {lo}..{hi}")


def _evict(root: Path) -> None:
    """Write back and drop from the page cache every file under ``root`` (the bench's "cold")."""
    drop_cache(sorted(p for p in root.rglob("*") if p.is_file()))


def _check_same(pool: Any, size: Size, src: torch.Tensor, dst: torch.Tensor) -> None:
    step = size.page_tokens
    for a, b in zip(src[::step].tolist(), dst[::step].tolist(), strict=True):
        if not torch.equal(pool.get_data_page(a).view(torch.int16), pool.get_data_page(b).view(torch.int16)):
            raise RuntimeError(f"page read back into host slot {b} differs from slot {a}")


class _Round:
    """One round of one page size: the same pages through raw disk, HiCacheFile and hicached."""

    def __init__(self, pool: Any, size: Size, src: torch.Tensor, dst: torch.Tensor, workdir: Path) -> None:
        self.pool, self.size, self.src, self.dst, self.workdir = pool, size, src, dst, workdir
        tag = uuid.uuid4().hex[:8]
        self.keys = [f"bench{tag}{i:06d}" for i in range(size.pages)]

    def _slots(self, idx: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        t = self.size.page_tokens
        return idx[lo * t : hi * t]

    def disk(self) -> tuple[float, float]:
        """Seconds to write the bytes to one file (to fdatasync), and to read them back cold."""
        s = self.size
        flat = self.pool.kv_buffer.view(torch.uint8).reshape(-1)[: s.nbytes].numpy()
        chunk = BATCH * s.page_bytes
        path = self.workdir / "raw.dat"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:

            def write() -> None:
                for off in range(0, s.nbytes, chunk):
                    os.pwrite(fd, flat[off : off + chunk], off)
                os.fdatasync(fd)

            t_write = timed(write)
            _evict(path.parent)
            out = bytearray(chunk)

            def read() -> None:
                for off in range(0, s.nbytes, chunk):
                    os.preadv(fd, [out], off)

            t_read = timed(read)
        finally:
            os.close(fd)
            path.unlink()
        return t_write, t_read

    def hicachefile(self) -> tuple[float, float, float]:
        """Seconds of HiCacheFile's set, hot get (page cache) and cold get (files evicted)."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # type: ignore[import-untyped]

        directory = self.workdir / "file"
        extra = {"file_storage_path": str(directory), "enable_metadata_cache": False}
        storage = HiCacheFile(_storage_config("bench/file", extra))
        pool, t = self.pool, self.size.page_tokens

        # SGLang's generic page path (cache_controller._generic_page_set/_get).
        def put() -> None:
            for lo, hi in _batches(self.size.pages):
                data = [pool.get_data_page(int(self.src[i * t])) for i in range(lo, hi)]
                if not storage.batch_set(self.keys[lo:hi], data):
                    raise RuntimeError("HiCacheFile batch_set failed")

        def get() -> None:
            _hit_query(storage, self.keys)
            for lo, hi in _batches(self.size.pages):
                targets = [pool.get_dummy_flat_data_page() for _ in range(lo, hi)]
                pages = storage.batch_get(self.keys[lo:hi], targets)
                for i, page in zip(range(lo, hi), pages, strict=True):
                    if page is None:
                        raise RuntimeError("HiCacheFile batch_get missed")
                    pool.set_from_flat_data_page(int(self.dst[i * t]), page)

        t_set = timed(put)
        t_hot = timed(get)
        _check_same(pool, self.size, self.src, self.dst)
        _evict(directory)
        t_cold = timed(get)
        _check_same(pool, self.size, self.src, self.dst)
        shutil.rmtree(directory, ignore_errors=True)
        return t_set, t_hot, t_cold

    def _storage(self, target: str) -> Any:
        from sglang.srt.mem_cache.storage.backend_factory import (  # type: ignore[import-untyped]
            StorageBackendFactory,
        )

        extra = {
            "backend_name": "hicached",
            "module_path": "hicached_client.sglang",
            "class_name": "HiCachedStorage",
            "interface_v1": 1,
            "hicached": {
                "target": target,
                "staging_pages": BATCH,
                "host_bytes": (self.size.pages + BATCH) * self.size.page_bytes,
            },
        }
        storage = StorageBackendFactory.create_backend(
            "dynamic", _storage_config("bench/hicached", extra), self.pool
        )
        storage.register_mem_pool_host(self.pool)
        path = storage.links["kv"].path
        if path != "zero-copy":
            storage.close()
            raise RuntimeError(f"hicached chose the {path} path for a sealed shm page_first pool")
        return storage

    def _get(self, storage: Any) -> None:
        _hit_query(storage, self.keys)
        for lo, hi in _batches(self.size.pages):
            if not all(storage.batch_get_v1(self.keys[lo:hi], self._slots(self.dst, lo, hi))):
                raise RuntimeError("hicached batch_get_v1 missed")

    def hicached(self) -> tuple[float, float, float]:
        """Seconds of hicached's set (until in L3), warm get (L2 hit), cold get (restarted, L3 evicted)."""
        s = self.size
        budget = f"{max(256, (3 * s.nbytes) >> 20)}MiB"
        l3 = self.workdir / "l3"
        (self.workdir / "a").mkdir()
        (self.workdir / "b").mkdir()
        with running_daemon(self.workdir / "a", host_budget=budget, l3="file", l3_path=l3) as target:
            storage = self._storage(target)
            link = storage.links["kv"]
            try:

                def put() -> None:
                    for lo, hi in _batches(s.pages):
                        if not all(storage.batch_set_v1(self.keys[lo:hi], self._slots(self.src, lo, hi))):
                            raise RuntimeError("hicached batch_set_v1 failed")
                    # Durable like HiCacheFile's files: every page acknowledged by the L3.
                    for lo, hi in _batches(s.pages):
                        keys = link.keys.daemon_keys(self.keys[lo:hi])
                        done = link.call(lambda session, _: session.backup(keys, wait=True))  # noqa: B023
                        if done.stored_pages != done.queued_pages:
                            raise RuntimeError(f"L3 stored {done.stored_pages} of {done.queued_pages} pages")

                t_set = timed(put)
                t_warm = timed(lambda: self._get(storage))
                _check_same(self.pool, s, self.src, self.dst)
            finally:
                storage.close()
        with running_daemon(self.workdir / "b", host_budget=budget, l3="file", l3_path=l3) as target:
            storage = self._storage(target)
            try:
                _evict(l3)  # after the new daemon's start-up scan of the slot headers
                t_cold = timed(lambda: self._get(storage))
                _check_same(self.pool, s, self.src, self.dst)
            finally:
                storage.close()
        return t_set, t_warm, t_cold


def _memcpy_gbps(nbytes: int) -> float:
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    b.copy_(a)  # warm
    return gbps(nbytes, min(timed(lambda: b.copy_(a)) for _ in range(3)))


def _measure(size: Size, rounds: int, workdir: Path) -> dict[str, float]:
    pool = _host_pool(size)
    src = pool.alloc(size.pages * size.page_tokens)
    dst = pool.alloc(size.pages * size.page_tokens)
    samples: dict[str, list[float]] = {}
    for i in range(rounds):
        rdir = workdir / f"{size.page_tokens}-{i}"
        rdir.mkdir()
        r = _Round(pool, size, src, dst, rdir)
        times = dict(zip(("disk_write", "disk_cold_read"), r.disk(), strict=True))
        times.update(zip(("file_set", "file_hot_get", "file_cold_get"), r.hicachefile(), strict=True))
        times.update(
            zip(("hicached_set", "hicached_warm_get", "hicached_cold_get"), r.hicached(), strict=True)
        )
        shutil.rmtree(rdir, ignore_errors=True)
        rates = {k: gbps(size.nbytes, v) for k, v in times.items()}
        for name, value in rates.items():
            samples.setdefault(f"sglang_{name}_gbps", []).append(value)
        for name, fig, base in (
            ("sglang_set_vs_file", "hicached_set", "file_set"),
            ("sglang_cold_get_vs_file", "hicached_cold_get", "file_cold_get"),
            ("sglang_warm_get_vs_file", "hicached_warm_get", "file_hot_get"),
            ("sglang_cold_get_vs_disk", "hicached_cold_get", "disk_cold_read"),
        ):
            samples.setdefault(name, []).append(rates[fig] / rates[base] if rates[base] else 0.0)
    out = {f"{k}{size.suffix}": statistics.median(v) for k, v in samples.items()}
    out[f"sglang_pages{size.suffix}"] = float(size.pages)
    out[f"sglang_page_bytes{size.suffix}"] = float(size.page_bytes)
    out[f"sglang_memcpy_gbps{size.suffix}"] = _memcpy_gbps(size.nbytes)
    return out


def run(
    quick: bool, *, pages: int | None = None, pages_1m: int | None = None, rounds: int | None = None
) -> dict[str, float]:
    """SGLang's storage calls through the daemon vs HiCacheFile and the raw disk (GB/s, ratios).

    Defaults: 2,048 pages of 64 KiB and 512 of 1 MiB, 3 rounds (``quick``: 256
    and 64, 1 round); 0 pages leaves a size out.
    """
    why_not = missing_package("sglang") or missing_package("transformers")
    if why_not:
        raise SuiteSkipped(why_not)
    ensure_sglang_importable()
    rounds = rounds if rounds is not None else (1 if quick else 3)
    sizes = [
        Size("", 4, pages if pages is not None else (256 if quick else 2048)),
        Size("_1m", 64, pages_1m if pages_1m is not None else (64 if quick else 512)),
    ]
    if rounds < 1 or any(s.pages < 0 for s in sizes):
        raise ValueError(f"sglang bench: rounds must be >= 1 and pages >= 0 (got {rounds}, {sizes})")
    workdir = Path(tempfile.mkdtemp(prefix="hicached-bench-sglang-"))
    results: dict[str, float] = {"sglang_rounds": float(rounds)}
    try:
        for size in sizes:
            if size.pages:
                results.update(_measure(size, rounds, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results
