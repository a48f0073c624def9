"""Copy routing: (source medium, destination medium) -> page-copy function.

The CPU<->CPU route is the first-class one (CPU workers and every test use it).
Index ops reach memcpy speed only on wide element views and preallocated outputs
(see PERF-NOTES), so every tensor is viewed as rows of 8-byte words first. Then, in
order of preference: runs contiguous on both sides are copied as slices; a gather
lands straight in contiguous destination runs (``index_select(out=)``); a scatter
from contiguous source runs goes through numpy row assignment (memcpy per row,
GIL released); only pages scattered on both sides pass through a per-thread
staging buffer that lives as long as its worker thread.

Routes touching CUDA live in :mod:`hicached.transfer.cuda` and are imported the
first time a CUDA tensor is copied, never on CPU machines.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from hicached.errors import InvalidArgument, OutOfRange
from hicached.page_arrays import SMALL_BATCH
from hicached.transfer.handles import Medium, medium_of
from hicached.transfer.plan import PageCopy
from hicached.transfer.runs import Run, clip, few_runs
from hicached.transfer.words import NUMPY_WORDS, CopyRows, copy_rows

log = logging.getLogger(__name__)

STAGING_BYTES = 16 << 20
# A scatter is split across helper threads only in parts of at least this size.
SPLIT_MIN_BYTES = 4 << 20

CopyFn = Callable[[PageCopy, "CopyContext"], None]


class Staging:
    """A reusable scratch buffer owned by one thread, allocated on first use (its first touch
    is paid once, and never by a thread whose copies need no staging: runs on either side)."""

    def __init__(self, nbytes: int = STAGING_BYTES, *, pin: bool = False) -> None:
        self._pin = pin  # page-locked, for CUDA transfers (only valid with CUDA present)
        self._size = nbytes
        self._buf: torch.Tensor | None = None

    def _alloc(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        buf.zero_()  # fault the pages in once, at the first use, not page by page in later copies
        return buf

    @property
    def allocated(self) -> bool:
        return self._buf is not None

    @property
    def nbytes(self) -> int:
        return self._size

    def rows(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous (n, *like.shape[1:]) tensor of like.dtype in the buffer (grown if needed)."""
        shape = (n, *like.shape[1:])
        need = int(np.prod(shape)) * like.element_size()
        if self._buf is None or need > self._size:
            self._size = max(self._size, need)
            self._buf = self._alloc(self._size)
        return self._buf[:need].view(like.dtype).view(shape)


class CopyContext:
    """Per-worker-thread copy state: staging buffers and route-specific resources.

    Used by one thread at a time. ``defer`` registers work that must finish before
    a layer is reported done (e.g. a CUDA stream synchronisation); ``flush`` runs it.
    ``resources`` holds route state (CUDA streams, pinned buffers) keyed by route
    module; each value with a ``close()`` is closed by :meth:`close`. ``helpers``
    (owned by the engine, shared by its workers) lets a large numpy scatter use up
    to ``parallelism`` threads, as torch's own index ops do.
    """

    def __init__(
        self,
        staging_bytes: int = STAGING_BYTES,
        *,
        helpers: Executor | None = None,
        parallelism: int = 1,
    ) -> None:
        self.staging = Staging(staging_bytes)
        self.resources: dict[str, object] = {}
        self.helpers = helpers
        self.parallelism = max(1, parallelism) if helpers is not None else 1
        self._deferred: list[Callable[[], None]] = []

    def defer(self, fn: Callable[[], None]) -> None:
        self._deferred.append(fn)

    def flush(self) -> None:
        pending, self._deferred = self._deferred, []
        for fn in pending:
            fn()

    def settle(self) -> None:
        """Like flush after a failure: run every deferred item, log (not raise) their errors."""
        pending, self._deferred = self._deferred, []
        for fn in pending:
            try:
                fn()
            except Exception:
                log.exception("deferred copy completion failed")

    def close(self) -> None:
        self.settle()
        for res in self.resources.values():
            close = getattr(res, "close", None)
            if callable(close):
                close()
        self.resources.clear()


_ROUTES: dict[tuple[Medium, Medium], CopyFn] = {}
# Media whose routes live in a module imported on first use.
_LAZY_MODULES: dict[Medium, str] = {Medium.CUDA: "hicached.transfer.cuda"}
_routes_lock = threading.Lock()


def register_route(src: Medium, dst: Medium, fn: CopyFn) -> None:
    """Register the copy function of one (src, dst) pair; replaces an earlier one."""
    with _routes_lock:
        _ROUTES[(src, dst)] = fn


def route(src: Medium, dst: Medium) -> CopyFn:
    """The copy function for (src, dst); InvalidArgument when there is none."""
    fn = _ROUTES.get((src, dst))
    if fn is None:
        for medium in (src, dst):
            module = _LAZY_MODULES.get(medium)
            if module is not None:
                importlib.import_module(module)  # registers its routes
        fn = _ROUTES.get((src, dst))
    if fn is None:
        raise InvalidArgument(f"no copy route from {src} to {dst}")
    return fn


def run_copy(copy: PageCopy, ctx: CopyContext) -> None:
    """Perform one page copy on the route its tensors' devices select."""
    route(medium_of(copy.src), medium_of(copy.dst))(copy, ctx)


def run_copies(copies: Sequence[PageCopy], ctx: CopyContext, *, nbytes: int | None = None) -> None:
    """Perform ``copies``; a large CPU-to-CPU set is shared out across ``ctx.helpers``.

    One hand-off per set (a layer, or a whole plan without progress reports) instead of
    one per copy: waking a helper thread costs 0.05-1.5 ms on a loaded 2-core machine,
    as much as copying a few MiB. Every page is bounds-checked, and each distinct page
    pair analysed into runs, on the calling thread before any part starts (a plan's
    copies of one pool share their arrays across layers: one analysis for all of them).
    The parts are taken from one list by the caller and the helpers alike, largest first
    (:func:`_parts`), so a helper that wakes late or runs on a busier core takes fewer
    of them instead of making the caller wait at the end. A set of long runs (each at
    least MIN_PART_BYTES) under RUNS_INLINE_MAX_BYTES stays on the calling thread, torch
    splitting each run. ``nbytes``: the copies' bytes, where the caller counted them.
    """
    threads, total = 1, 0
    if ctx.helpers is not None and ctx.parallelism > 1:
        total = nbytes if nbytes is not None else sum(c.nbytes for c in copies)
        threads = min(ctx.parallelism, total // SPLIT_MIN_BYTES)
    cpu = threads > 1 and all(
        medium_of(c.src) is Medium.CPU and medium_of(c.dst) is Medium.CPU for c in copies
    )
    if not cpu:
        for c in copies:
            if c.rows is not None:  # planned word rows exist only for CPU pairs: no route lookup
                copy_cpu_cpu(c, ctx)
            else:
                run_copy(c, ctx)
        return
    planned = [_planned(c, ctx) for c in copies if len(c.src_pages)]
    if total < RUNS_INLINE_MAX_BYTES and all(_long_runs(p) for p in planned):
        for p in planned:  # torch splits each run over its own threads
            _copy_range(p.src, p.dst, p.src_pages, p.dst_pages, p.shape, 0, len(p.src_pages), ctx)
        return
    parts = _parts(planned, threads)
    taken = itertools.count()  # next() on a count is atomic under the GIL: each part runs once
    assert ctx.helpers is not None
    futures = [ctx.helpers.submit(_run_parts, parts, taken, None) for _ in range(threads - 1)]
    ctx.parallelism, parallelism = 1, ctx.parallelism  # this thread's parts: no nested split
    try:
        _run_parts(parts, taken, ctx)
    finally:
        ctx.parallelism = parallelism
        for f in futures:
            f.result()


# A copy of runs on both sides up to this size goes through numpy, one slice assignment per
# run: a torch copy_ call costs ~3 us before its first byte, numpy's ~0.4 us (a copy per
# layer of every Write: 64 of them for one page of a 32-layer model). Measured on 2 cores,
# numpy stays ahead up to 256 KiB a run; beyond, torch splits a run over its threads.
NUMPY_COPY_MAX_BYTES = 256 << 10

# A set is shared out in parts of at least this size: small enough that the last ones
# even out the threads' finishing times, large enough that a part's Python cost (a few
# microseconds) stays far below its copy.
MIN_PART_BYTES = 1 << 20

# A set made only of long runs (each at least MIN_PART_BYTES) and smaller than this is
# copied on the calling thread, one tensor copy per run that torch splits over its own
# threads: no helper to wake. Measured on 2 cores, SGLang warm gets of 128 x 64 KiB pages
# (one 8 MiB run per batch, repeated): 5.6-5.9 GB/s against 4.3-5.6 shared out in parts.
# One 128 MiB run per batch (1 MiB pages) ran faster in parts taken as threads free up
# (14.5-20.0 GB/s against 10.5-14.9 when torch split it), so large sets are shared out.
RUNS_INLINE_MAX_BYTES = 64 << 20

_helper = threading.local()


class _Planned(NamedTuple):
    """One copy as word rows, with its runs analysed (:func:`_shape_of`). A tuple: one is
    made per copy of every set, and a frozen dataclass costs several times more to build."""

    src: torch.Tensor
    dst: torch.Tensor
    src_pages: np.ndarray
    dst_pages: np.ndarray
    shape: _Shape
    row_bytes: int


def _planned(copy: PageCopy, ctx: CopyContext) -> _Planned:
    rows, shape = _analysed(copy, ctx)
    src = rows.src
    row_bytes = math.prod(src.shape[1:]) * src.element_size()
    return _Planned(src, rows.dst, copy.src_pages, copy.dst_pages, shape, row_bytes)


def _long_runs(p: _Planned) -> bool:
    runs = p.shape.both
    return runs is not None and all(r.count * p.row_bytes >= MIN_PART_BYTES for r in runs)


def _parts(planned: list[_Planned], threads: int) -> list[tuple[_Planned, int, int]]:
    """Position ranges of the copies, in the order they are taken: each about a
    ``2 * threads``-th of what is left (at least MIN_PART_BYTES), so sizes shrink to the end."""
    left = sum(len(p.src_pages) * p.row_bytes for p in planned)
    out = []
    for p in planned:
        n = len(p.src_pages)
        row = max(1, p.row_bytes)
        pos = 0
        while pos < n:
            take = min(n - pos, max(1, max(MIN_PART_BYTES, left // (2 * threads)) // row))
            out.append((p, pos, pos + take))
            pos += take
            left -= take * row
    return out


def _run_parts(
    parts: list[tuple[_Planned, int, int]], taken: itertools.count[int], ctx: CopyContext | None
) -> None:
    """Take parts until none is left; a helper uses its own context (its staging buffer
    lives as long as the thread, which the engine owns)."""
    if ctx is None:
        ctx = getattr(_helper, "ctx", None)
        if ctx is None:
            ctx = _helper.ctx = CopyContext()
    while (k := next(taken)) < len(parts):
        p, lo, hi = parts[k]
        _copy_range(p.src, p.dst, p.src_pages, p.dst_pages, p.shape, lo, hi, ctx)


@dataclass(frozen=True)
class _Shape:
    """How a (source pages, destination pages) pair is copied: the same for every layer."""

    both: list[Run] | None
    dst_runs: list[Run] | None
    src_runs: list[Run] | None


# A plan's copies of one pool share their page arrays across every layer (2 x layers
# copies), so the run analysis is done once per pair. Entries hold the arrays
# themselves, so an id() in a key can never be reused by another array while cached.
_SHAPES_MAX = 64


def _shape_of(
    ctx: CopyContext, sp: np.ndarray, dp: np.ndarray, limits: tuple[int, int], dst_contiguous: bool
) -> _Shape:
    cache = ctx.resources.get("copy_shapes")
    if cache is None:
        cache = ctx.resources["copy_shapes"] = OrderedDict()
    assert isinstance(cache, OrderedDict)
    key = (id(sp), id(dp), limits, dst_contiguous)
    hit = cache.get(key)
    if hit is not None and hit[0] is sp and hit[1] is dp:
        shape: _Shape = hit[2]
        return shape
    n = len(sp)
    check_bounds("source", sp, limits[0])
    check_bounds("destination", dp, limits[1])
    both = few_runs(sp, dp, n=n)
    dst_runs = few_runs(dp, n=n) if both is None and dst_contiguous else None
    src_runs = few_runs(sp, n=n) if both is None and dst_runs is None else None
    shape = _Shape(both, dst_runs, src_runs)
    cache[key] = (sp, dp, shape)
    while len(cache) > _SHAPES_MAX:
        cache.popitem(last=False)
    return shape


def copy_cpu_cpu(copy: PageCopy, ctx: CopyContext) -> None:
    """CPU pages to CPU pages in one pass when either side is made of runs, else via staging.

    OutOfRange (before anything is written) for a page beyond either tensor.
    """
    n = len(copy.src_pages)
    if n == 0:
        return
    rows, shape = _analysed(copy, ctx)
    if shape.both is not None and rows.arrays is not None and copy.nbytes <= NUMPY_COPY_MAX_BYTES:
        src, dst = rows.arrays
        for r in shape.both:
            dst[r.dst : r.dst + r.count] = src[r.src : r.src + r.count]
        return
    _copy_range(rows.src, rows.dst, copy.src_pages, copy.dst_pages, shape, 0, n, ctx)


def _analysed(copy: PageCopy, ctx: CopyContext) -> tuple[CopyRows, _Shape]:
    """A copy's (source, destination) word rows and its runs; OutOfRange for a bad page."""
    rows = copy.rows if copy.rows is not None else copy_rows(copy.src, copy.dst)
    return rows, _shape_of(ctx, copy.src_pages, copy.dst_pages, rows.limits, rows.dst_contiguous)


def _copy_range(
    src: torch.Tensor,
    dst: torch.Tensor,
    sp: np.ndarray,
    dp: np.ndarray,
    shape: _Shape,
    lo: int,
    hi: int,
    ctx: CopyContext,
) -> None:
    """Copy positions [lo, hi) of an analysed copy (its pages already bounds-checked)."""
    whole = lo == 0 and hi == len(sp)  # no clipping: most copies (every small one) are whole
    if shape.both is not None:
        for r in shape.both if whole else clip(shape.both, lo, hi):
            dst[r.dst : r.dst + r.count].copy_(src[r.src : r.src + r.count])
        return
    if shape.dst_runs is not None:
        # Gather straight into each destination run (one pass).
        for r in shape.dst_runs if whole else clip(shape.dst_runs, lo, hi):
            gather_rows(src, sp[r.pos : r.pos + r.count], dst[r.dst : r.dst + r.count], ctx)
        return
    if shape.src_runs is not None:
        # Scatter each source run straight into place (one pass).
        for r in shape.src_runs if whole else clip(shape.src_runs, lo, hi):
            scatter_rows(dst, dp[r.pos : r.pos + r.count], src[r.src : r.src + r.count], ctx)
        return
    # Scattered on both sides: gather into staging, scatter from it, chunk by chunk.
    per_chunk = max(1, ctx.staging.nbytes // max(1, src[0].numel() * src.element_size()))
    for a in range(lo, hi, per_chunk):
        b = min(hi, a + per_chunk)
        stage = ctx.staging.rows(b - a, src)
        gather_rows(src, sp[a:b], stage, ctx)
        scatter_rows(dst, dp[a:b], stage, ctx)


def check_bounds(side: str, pages: np.ndarray, limit: int) -> None:
    """OutOfRange unless every page is in [0, limit) (kernels below must never see a bad index)."""
    if len(pages) <= SMALL_BATCH:
        listed = pages.tolist()
        lo, hi = min(listed), max(listed)
    else:
        lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise OutOfRange(f"{side} page {bad} is out of range [0, {limit})")


def _numpy_ok(*tensors: torch.Tensor) -> bool:
    """Element views that are not word rows (numpy has no bfloat16) go through torch."""
    dtype = tensors[0].dtype
    return dtype in NUMPY_WORDS and all(t.dtype == dtype for t in tensors)


def gather_rows(src: torch.Tensor, pages: np.ndarray, out: torch.Tensor, ctx: CopyContext) -> None:
    """``out[:] = src[pages]`` into a preallocated contiguous ``out``; pages already bounds-checked.

    ``np.take(mode="clip", out=)`` runs at memcpy speed on word rows (measured 13-14
    GB/s on one thread; the default mode buffers the output and runs at a third of
    that). A source that is not C-contiguous would be copied whole by numpy, so it
    goes through ``torch.index_select(out=)`` instead.
    """
    if not (_numpy_ok(src, out) and src.is_contiguous() and out.is_contiguous()):
        torch.index_select(src, 0, torch.from_numpy(pages), out=out)
        return
    src_np, out_np = src.numpy(), out.numpy()

    def take(lo: int, hi: int) -> None:
        # "clip" never clips here: the caller checked the bounds.
        np.take(src_np, pages[lo:hi], axis=0, out=out_np[lo:hi], mode="clip")

    _split(ctx, len(pages), out.numel() * out.element_size(), take)


def scatter_rows(dst: torch.Tensor, pages: np.ndarray, rows: torch.Tensor, ctx: CopyContext) -> None:
    """``dst[pages] = rows`` without temporaries; pages already bounds-checked.

    numpy's row-indexed assignment copies each row with memcpy and releases the
    GIL; ``index_copy_`` walks element by element and runs at a fraction of that
    (measured 6-8 vs 13-14 GB/s single-threaded on 16 KiB rows).
    """
    if not _numpy_ok(dst, rows):
        dst.index_copy_(0, torch.from_numpy(pages), rows)
        return
    dst_np, rows_np = dst.numpy(), rows.numpy()

    def put(lo: int, hi: int) -> None:
        dst_np[pages[lo:hi]] = rows_np[lo:hi]

    _split(ctx, len(pages), rows.numel() * rows.element_size(), put)


def _split(ctx: CopyContext, n: int, nbytes: int, fn: Callable[[int, int], None]) -> None:
    """Run ``fn(lo, hi)`` over [0, n) in parts, on the caller and on ``ctx.helpers``.

    A large copy uses as many threads as a torch index op would; parts are at
    least SPLIT_MIN_BYTES so that the hand-off never costs more than it saves.
    """
    parts = min(ctx.parallelism, max(1, nbytes // SPLIT_MIN_BYTES), n)
    if parts <= 1 or ctx.helpers is None:
        fn(0, n)
        return
    bounds = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
    futures = [ctx.helpers.submit(fn, lo, hi) for lo, hi in itertools.pairwise(bounds[1:])]
    try:
        fn(0, bounds[1])
    finally:
        for f in futures:
            f.result()


register_route(Medium.CPU, Medium.CPU, copy_cpu_cpu)
