"""End-to-end benchmark: a real daemon process and this process as its worker.

The worker's "device" KV pool lives in POSIX shared memory (the CPU data
plane). In the same run it measures the machine's own limits beside the
daemon's figures: a plain in-process page gather of the same pages
(``memcpy_gbps``), the same gather between two shared-memory segments
(``memcpy_shm_gbps``: the kind of memory the daemon copies between), the same pages
gathered out of the worker's own pool in its layout, one 16 KiB row per layer and K/V
(``memcpy_layout_gbps``: the rows the daemon's copy moves), and a bare gRPC echo on the
same server and socket (``echo_rtt_us``). ``write_gbps`` /
``load_gbps`` go over gRPC, ``fastlane_write_gbps`` / ``fastlane_load_gbps`` the same
pages over the session's fast lane. Every loaded byte is compared with what was written
(``verified``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hicached_client import (
    HiCacheClient,
    HiCacheError,
    Session,
    Transfer,
    WorkerIdentity,
    WriteResult,
    pool_spec,
)
from hicached_client.export import ShmKVPool
from hicached_client.fastlane import FastLane

from hicached.bench.timing import timed
from hicached.shm import SharedSegment
from hicached.testing.daemon import launch

log = logging.getLogger(__name__)

# 2 layers x K/V x 16 tokens x 4 heads x 128 dims x bf16 = 64 KiB per page.
LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 128, 16
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2


@contextlib.contextmanager
def running_daemon(
    workdir: Path,
    *,
    host_budget: str,
    l3: str = "file",
    l3_path: Path | None = None,
    ready_timeout_s: float = 60.0,
    on_start: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """A ``hicached serve`` subprocess (:func:`hicached.testing.daemon.launch`) on a socket in
    ``workdir``; yields its target.

    ``l3_path`` (default ``workdir/l3``) lets a second daemon find the first one's L3.
    ``on_start`` gets the daemon's pid (the soak samples its RSS and fds). The daemon inherits
    this process's environment, ``HICACHED_*`` included (a user's settings apply). If it exits
    before it is ready (or while the body runs), raises :class:`DaemonDied` with the end of
    its log (the log lives in ``workdir``).
    """
    daemon = launch(
        "--host-budget", host_budget,
        "--l3", l3,
        "--l3-path", str(l3_path or workdir / "l3"),
        "--log-level", "warning",
        workdir=workdir, socket=workdir / "bench.sock", shm_prefix=f"hcbench{os.getpid()}",
        clean_env=False, timeout_s=ready_timeout_s,
    )  # fmt: skip
    try:
        if on_start is not None:
            on_start(daemon.process.pid)
        try:
            yield daemon.target
        except Exception as exc:
            if daemon.process.poll() is not None:
                raise daemon.died("while the benchmark ran") from exc
            raise
    finally:
        daemon.stop(timeout_s=30)


def _rtt_us(fn: Callable[[], object], n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


class _Gather:
    """The machine's limit for the same work: one index_select of the same 64 KiB pages
    (viewed as int64 rows) into a preallocated buffer, in warm private memory; with
    ``shared``, between two prefaulted ``/dev/shm`` segments, as the daemon's copies run
    (on a machine whose shmem_enabled is ``never`` those are 4 KiB pages, private memory
    may be huge pages). :meth:`close` unlinks the segments."""

    def __init__(self, device_pages: int, pages: np.ndarray, *, shared: bool = False) -> None:
        words = PAGE_BYTES // 8
        self._segments: list[SharedSegment] = []
        if shared:
            tag = f"hcbench-gather-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                for name, rows in (("src", device_pages), ("dst", len(pages))):
                    self._segments.append(SharedSegment.create(f"{tag}-{name}", rows * PAGE_BYTES))
            except BaseException:
                self._release()  # the one made before the failure
                raise
            self.src = self._segments[0].tensor(torch.int64, (device_pages, words))
            self.dst = self._segments[1].tensor(torch.int64, (len(pages), words))
            self.src.fill_(1)
        else:
            self.src = torch.ones(device_pages, words, dtype=torch.int64)
            self.dst = torch.zeros(len(pages), words, dtype=torch.int64)
        self.idx = torch.from_numpy(pages)
        self()  # first touch

    def __call__(self) -> None:
        torch.index_select(self.src, 0, self.idx, out=self.dst)

    def close(self) -> None:
        del self.src, self.dst  # the views keep the mappings alive
        self._release()

    def _release(self) -> None:
        for segment in self._segments:
            segment.close()
            segment.unlink()
        self._segments.clear()


class _LayoutGather:
    """The same pages as the daemon's copy moves them: out of the worker's pool, one
    ``index_select`` per layer and K/V (rows of PAGE_BYTES / (2 * LAYERS)), into a prefaulted
    ``/dev/shm`` segment of the same shape. Reads the pool, never writes it. :meth:`close`
    unlinks the segment."""

    def __init__(self, pool: ShmKVPool, pages: np.ndarray) -> None:
        tensors = (*pool.k, *pool.v)
        self.src = [t.view(torch.int64).view(t.shape[0] // PAGE, -1) for t in tensors]
        rows = (len(tensors), len(pages), self.src[0].shape[1])
        tag = f"hcbench-layout-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._segment = SharedSegment.create(tag, math.prod(rows) * 8)
        self.idx = torch.from_numpy(pages)
        try:
            self.dst = self._segment.tensor(torch.int64, rows)
            self()  # first touch
        except BaseException:
            self._segment.close()
            self._segment.unlink()
            raise

    def __call__(self) -> None:
        for i, src in enumerate(self.src):
            torch.index_select(src, 0, self.idx, out=self.dst[i])

    def close(self) -> None:
        del self.src, self.dst  # the views keep the mappings alive
        self._segment.close()
        self._segment.unlink()


def run(quick: bool) -> dict[str, float]:
    pages_n = 1000
    reps = 5 if quick else 15
    rtt_n = 200 if quick else 1000
    device_pages = 2 * pages_n + 64
    rng = np.random.default_rng(0)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hicached-bench-") as tmp:
        workdir = Path(tmp)
        # Room for the write/load pages plus every keyed round's published pages (backups to
        # L3 hold entries until written, so they cannot all be evicted in time).
        keyed_rounds = min(reps, 5)
        host_ratio = (keyed_rounds + 2) * pages_n / device_pages
        budget = f"{int(host_ratio * device_pages + 64) * PAGE_BYTES // (1 << 20) + 64}MiB"
        pool = ShmKVPool(
            f"hcbench-{uuid.uuid4().hex[:8]}",
            num_layers=LAYERS,
            tokens=device_pages * PAGE,
            heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.bfloat16,
        )
        try:
            for t in (*pool.k, *pool.v):
                t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16))
            with running_daemon(workdir, host_budget=budget) as target, HiCacheClient(target) as client:
                spec = pool_spec(
                    "kv",
                    role="anchor",
                    kind="mha",
                    dtype="bfloat16",
                    page_size=PAGE,
                    num_layers=LAYERS,
                    num_heads=HEADS,
                    head_dim=HEAD_DIM,
                    k_buffers=pool.k_buffers(),
                    v_buffers=pool.v_buffers(),
                    host_ratio=host_ratio,
                )
                session = client.attach(WorkerIdentity("bench", 1, "bench-model"), [spec])
                out.update(_data_plane(session, pool, rng, pages_n, device_pages, reps))
                out["echo_rtt_us"] = _rtt_us(lambda: client.ping(b""), rtt_n)
                out["resolve_rtt_us"] = _resolve_rtt(session, rtt_n)
                out.update(_keyed(session, rng, pages_n, device_pages, keyed_rounds))
                session.detach()
        finally:
            pool.close()
            pool.unlink()
    return out


def _data_plane(
    session: Session, pool: ShmKVPool, rng: np.random.Generator, n: int, device_pages: int, reps: int
) -> dict[str, float]:
    """Write n random device pages (host pages allocated by the call), load them into other
    random device pages, verify; over gRPC, then the same over the session's fast lane. The
    plain gathers run between them so all see the same load."""
    picked = rng.choice(device_pages, size=n, replace=False).astype(np.int64)
    paths = {"": _Path(session.write, lambda b: session.load_wait(b, layer_progress=False))}
    with contextlib.ExitStack() as stack:
        gathers: dict[str, Callable[[], None]] = {"memcpy": _Gather(device_pages, picked)}
        shm = _Gather(device_pages, picked, shared=True)
        stack.callback(shm.close)
        layout = _LayoutGather(pool, picked)
        stack.callback(layout.close)
        gathers.update(memcpy_shm=shm, memcpy_layout=layout)
        try:
            lane = stack.enter_context(FastLane.open(session))
        except HiCacheError as exc:  # the user's settings turned the lane off
            log.warning("fastlane_write_gbps / fastlane_load_gbps left out: %s", exc.message)
        else:
            paths["fastlane_"] = _Path(lane.write, lambda b: lane.load(b, layer_progress=False))
        return _data_plane_reps(session, pool, rng, n, device_pages, reps, paths, gathers)


@dataclass(frozen=True)
class _Path:
    """How one transport writes (allocating host pages) and loads a batch, waiting for the end."""

    write: Callable[..., WriteResult]
    load: Callable[[list[Transfer]], object]


def _data_plane_reps(
    s: Session,
    pool: ShmKVPool,
    rng: np.random.Generator,
    n: int,
    device_pages: int,
    reps: int,
    paths: dict[str, _Path],
    gathers: dict[str, Callable[[], None]],
) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in gathers}
    verified = True
    for rep in range(reps + 1):  # rep 0 warms up: the daemon's first pass over a new mapping faults
        for name, gather in gathers.items():
            times[name].append(timed(gather))
        for prefix, path in paths.items():
            src = rng.choice(device_pages // 2, size=n, replace=False).astype(np.int64)
            dst = (rng.choice(device_pages // 2, size=n, replace=False) + device_pages // 2).astype(np.int64)
            t0 = time.perf_counter()
            w = path.write([Transfer("kv", src)], allocate=True)
            times.setdefault(f"{prefix}write", []).append(time.perf_counter() - t0)
            assert w.ok, "bench host pool too small"
            host = np.asarray(w.transfers[0].host_pages, dtype=np.int64)
            order = np.asarray(w.transfers[0].device_pages, dtype=np.int64)
            t0 = time.perf_counter()
            path.load([Transfer("kv", dst, host)])
            times.setdefault(f"{prefix}load", []).append(time.perf_counter() - t0)
            for t in (*pool.k, *pool.v):
                pages = t.view(torch.int16).view(t.shape[0] // PAGE, -1)  # bit patterns: random bf16 has NaNs
                verified &= bool(torch.equal(pages[torch.from_numpy(dst)], pages[torch.from_numpy(order)]))
            s.free("kv", host)
        if rep == 0:
            times = {k: [] for k in times}
    nbytes = n * PAGE_BYTES
    out = {f"{k}_gbps": nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    out["verified"] = float(verified)
    return out


def _resolve_rtt(session: Session, n: int) -> float:
    """ResolveTransfers of one scheduler step (8 pages) and its release, per call."""
    s = session
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = s.resolve_transfers([Transfer("kv", list(range(8)))])
        samples.append(time.perf_counter() - t0)
        s.release_transfers(r.transfers)
    return statistics.median(samples) * 1e6


def _keyed(
    session: Session, rng: np.random.Generator, n: int, device_pages: int, rounds: int
) -> dict[str, float]:
    """PutPages/GetPages of n pages addressed by fresh content keys; medians over rounds
    after one warm-up (write-through backups to L3 run in the background meanwhile)."""
    s = session
    put_t: list[float] = []
    get_t: list[float] = []
    ok = True
    for _ in range(rounds + 1):
        keys = [uuid.uuid4().hex for _ in range(n)]
        src = rng.choice(device_pages // 2, size=n, replace=False).astype(np.int64)
        dst = (rng.choice(device_pages // 2, size=n, replace=False) + device_pages // 2).astype(np.int64)
        t0 = time.perf_counter()
        put = s.put_pages(keys, [Transfer("kv", src)])
        put_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = s.get_pages(keys, [Transfer("kv", dst)])
        get_t.append(time.perf_counter() - t0)
        ok &= put.ok and got.hit_pages == n
    put_s, get_s = statistics.median(put_t[1:]), statistics.median(get_t[1:])
    return {
        "key_put_gbps": n * PAGE_BYTES / put_s / 1e9 if ok else 0.0,
        "key_get_gbps": n * PAGE_BYTES / get_s / 1e9 if ok else 0.0,
    }
