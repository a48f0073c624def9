"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (1e9 bytes per second); 0 for a zero duration."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
