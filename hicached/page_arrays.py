"""What the host pools (:mod:`hicached.l2`) and the copies (:mod:`hicached.transfer`) both know
about a batch of page numbers. Pure functions of numpy arrays; thread-safe."""

from __future__ import annotations

import numpy as np

__all__ = ["SMALL_BATCH", "ascending"]

# Up to this many pages, checks and copy runs are found on a Python list: a numpy call costs
# ~1 us whatever its size, so a handful of them outweighs a small batch's own work (a scheduler
# step is ~8 pages).
SMALL_BATCH = 64


def ascending(pages: np.ndarray) -> bool:
    """Whether ``pages`` strictly ascend: then no page repeats and the ends are the bounds.
    Pages freshly allocated, pinned in key order or sent by a worker mostly do, and this
    one comparison costs a third of a sort (3 against 9 us for 1,000 pages)."""
    return len(pages) < 2 or bool((pages[1:] > pages[:-1]).all())
