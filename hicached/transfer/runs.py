"""Runs of consecutive pages: the analysis that decides how a page copy moves.

A copy whose pages are consecutive on one side (or both) moves as slices or as one
gather/scatter per run instead of page by page. Pure functions of the page arrays;
thread-safe.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hicached.page_arrays import SMALL_BATCH

# A run of at least this many pages on average is cheaper as slice copies than as
# one index op (a torch call costs about as much as copying a few 64 KiB pages).
MIN_RUN_PAGES = 4


@dataclass(frozen=True)
class Run:
    """``count`` consecutive pages from ``src`` to ``dst``, at position ``pos`` of the copy."""

    pos: int
    src: int
    dst: int
    count: int


def run_starts(src_pages: np.ndarray, dst_pages: np.ndarray | None = None) -> np.ndarray:
    """Positions where a new run begins (source, and destination if given, consecutive)."""
    n = len(src_pages)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    brk = np.diff(src_pages) != 1
    if dst_pages is not None:
        brk |= np.diff(dst_pages) != 1
    return np.concatenate(([0], np.flatnonzero(brk) + 1))


def runs(src_pages: np.ndarray, dst_pages: np.ndarray | None = None) -> list[Run]:
    """Maximal runs where the source (and destination, if given) pages are both consecutive."""
    return _runs_at(run_starts(src_pages, dst_pages), src_pages, dst_pages)


def _runs_at(starts: np.ndarray, src_pages: np.ndarray, dst_pages: np.ndarray | None) -> list[Run]:
    if not len(starts):
        return []
    ends = np.append(starts[1:], len(src_pages))
    dst = dst_pages if dst_pages is not None else src_pages
    return [
        Run(pos=int(a), src=int(src_pages[a]), dst=int(dst[a]), count=int(b - a))
        for a, b in zip(starts, ends, strict=True)
    ]


def few_runs(src_pages: np.ndarray, dst_pages: np.ndarray | None = None, *, n: int) -> list[Run] | None:
    """The runs when they are long enough on average to copy one by one, else None.

    Counting first keeps the scattered case free of per-page Python objects.
    """
    if n <= SMALL_BATCH:
        found = _small_runs(src_pages.tolist(), dst_pages.tolist() if dst_pages is not None else None)
        return None if len(found) > 2 and len(found) * MIN_RUN_PAGES > n else found
    starts = run_starts(src_pages, dst_pages)
    # A copy of one or two runs is always cheaper as slices (a single page is one run of one).
    if len(starts) > 2 and len(starts) * MIN_RUN_PAGES > n:
        return None
    return _runs_at(starts, src_pages, dst_pages)


def _small_runs(src: list[int], dst: list[int] | None) -> list[Run]:
    """:func:`runs` of a small batch, in Python (numpy's fixed cost per call outweighs it)."""
    to = dst if dst is not None else src
    out = []
    start = 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or to[i] != to[i - 1] + 1:
            out.append(Run(pos=start, src=src[start], dst=to[start], count=i - start))
            start = i
    return out


def clip(found: list[Run], lo: int, hi: int) -> Iterator[Run]:
    """The parts of ``found`` (runs in position order, covering every position) in [lo, hi)."""
    for r in found[bisect.bisect_right(found, lo, key=lambda r: r.pos) - 1 :]:
        if r.pos >= hi:
            return
        a, b = max(lo, r.pos), min(hi, r.pos + r.count)
        yield Run(pos=a, src=r.src + a - r.pos, dst=r.dst + a - r.pos, count=b - a)
