"""GroupState's in-flight counts: a page listed twice in one copy is counted twice."""

from __future__ import annotations

import numpy as np
import pytest

from hicached.core.group_state import count


@pytest.mark.parametrize("n", [0, 1, 2, 4, 5, 16, 17, 64, 65, 200, 1000])
@pytest.mark.parametrize("order", ["ascending", "shuffled", "repeats"])
def test_count_adds_each_listed_page_as_add_at_does(n: int, order: str) -> None:
    rng = np.random.default_rng(n)
    pages = np.arange(3, 3 + 2 * n, 2, dtype=np.int64)
    if order == "shuffled":
        pages = rng.permutation(pages)
    elif order == "repeats" and n > 1:
        pages[rng.integers(0, n, size=max(1, n // 4))] = pages[0]  # some pages listed 2+ times
        pages = rng.permutation(pages)
    counts = rng.integers(0, 3, size=2 * n + 8).astype(np.int32)
    expected = counts.copy()
    np.add.at(expected, pages, 1)
    count(counts, pages, 1)
    assert counts.tolist() == expected.tolist()
    np.add.at(expected, pages, -1)
    count(counts, pages, -1)
    assert counts.tolist() == expected.tolist()
