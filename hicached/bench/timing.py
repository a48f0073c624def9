"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (1e9 bytes per second); 0 for a zero duration."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def drop_cache(paths: Iterable[Path]) -> None:
    """Write back each file and drop it from the page cache: a later read is a cold read
    from the disk (``fdatasync`` + ``POSIX_FADV_DONTNEED``; no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
