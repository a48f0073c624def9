"""PageAllocator: page-aligned, copies out, detects double alloc/free, thread-safe."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hicached.errors import DoubleFree, FailedPrecondition, InvalidArgument, OutOfRange
from hicached.l2 import PageAllocator
from hicached.l2.allocator import first_repeat, first_repeat_of
from hicached.page_arrays import SMALL_BATCH


def _state(a: PageAllocator) -> tuple[int, list[int]]:
    return a.available(), a.allocated_pages().tolist()


def test_fresh_pool_hands_out_low_contiguous_pages() -> None:
    a = PageAllocator(10)
    assert a.alloc(3).tolist() == [0, 1, 2]  # type: ignore[union-attr]
    assert a.alloc(2).tolist() == [3, 4]  # type: ignore[union-attr]
    assert a.available() == 5
    assert a.allocated_count() == 5


def test_returns_none_not_an_exception_when_full() -> None:
    a = PageAllocator(4)
    assert a.alloc(5) is None
    assert a.available() == 4
    pages = a.alloc(4)
    assert pages is not None
    assert a.alloc(1) is None
    assert a.alloc(0) is not None and a.alloc(0).size == 0  # type: ignore[union-attr]


def test_indices_are_copies_never_views_of_state() -> None:
    a = PageAllocator(8)
    pages = a.alloc(3)
    assert pages is not None and pages.dtype == np.int64 and pages.flags.owndata
    pages[:] = 7  # must not corrupt the allocator (sglang#19332)
    assert a.allocated_pages().tolist() == [0, 1, 2]
    assert a.alloc(1).tolist() == [3]  # type: ignore[union-attr]
    given = np.array([0, 1], dtype=np.int64)
    a.free(given)
    given[:] = 5
    assert a.alloc(2).tolist() == [0, 1]  # type: ignore[union-attr]


def test_freed_pages_come_back_ascending() -> None:
    a = PageAllocator(8)
    a.alloc(8)
    a.free([6, 2, 4])
    assert a.alloc(3).tolist() == [2, 4, 6]  # type: ignore[union-attr]


def test_double_free_is_detected_and_changes_nothing() -> None:
    a = PageAllocator(8)
    a.alloc(4)
    a.free([1])
    before = _state(a)
    with pytest.raises(DoubleFree, match="page 1 "):
        a.free([0, 1])  # page 0 is valid, but nothing may be freed
    assert _state(a) == before


def test_duplicates_in_one_free_are_rejected() -> None:
    a = PageAllocator(8)
    a.alloc(4)
    before = _state(a)
    with pytest.raises(InvalidArgument, match="page 2 is listed more than once"):
        a.free([2, 3, 2])
    assert _state(a) == before


@pytest.mark.parametrize("bad", [-1, 8, 100])
def test_out_of_range_free_names_the_page(bad: int) -> None:
    a = PageAllocator(8)
    a.alloc(8)
    with pytest.raises(OutOfRange, match=f"page {bad} is out of range"):
        a.free([0, bad])
    assert a.available() == 0


def test_malformed_indices_are_rejected() -> None:
    a = PageAllocator(8)
    a.alloc(2)
    with pytest.raises(InvalidArgument, match="1-D"):
        a.free(np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(InvalidArgument, match="float"):
        a.free(np.array([0.0, 1.0]))
    with pytest.raises(InvalidArgument, match="-3"):
        a.alloc(-3)
    assert a.available() == 6


def test_mark_allocated_replays_a_journal_and_detects_double_alloc() -> None:
    a = PageAllocator(8)
    a.mark_allocated([5, 1])
    assert a.is_allocated([0, 1, 5]).tolist() == [False, True, True]
    assert a.available() == 6
    before = _state(a)
    with pytest.raises(FailedPrecondition, match="page 5 is already allocated"):
        a.mark_allocated([2, 5])
    assert _state(a) == before
    got = a.alloc(6)
    assert got is not None and sorted(got.tolist()) == [0, 2, 3, 4, 6, 7]


def test_token_api_is_page_aligned() -> None:
    a = PageAllocator(4, page_size=16)
    tokens = a.alloc_tokens(32)
    assert tokens is not None and tokens.tolist() == list(range(32))
    with pytest.raises(InvalidArgument, match="token count 20 is not a multiple of the page size 16"):
        a.alloc_tokens(20)
    with pytest.raises(InvalidArgument, match="starting at 8"):
        a.free_tokens(np.arange(8, 24))
    assert a.available() == 2
    assert a.free_tokens(tokens) == 2
    assert a.available() == 4
    assert a.alloc_tokens(16 * 5) is None


def test_is_allocated_checks_range() -> None:
    a = PageAllocator(4)
    with pytest.raises(OutOfRange, match="page 4"):
        a.is_allocated([4])


def test_bad_capacity_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="-1"):
        PageAllocator(-1)
    with pytest.raises(InvalidArgument, match="page_size"):
        PageAllocator(4, page_size=0)


def test_concurrent_alloc_and_free_never_hand_out_a_page_twice() -> None:
    a = PageAllocator(256)
    start = threading.Barrier(4)
    errors: list[BaseException] = []
    seen: list[list[int]] = [[] for _ in range(4)]

    def worker(i: int) -> None:
        try:
            start.wait()
            rng = np.random.default_rng(i)
            held: list[np.ndarray] = []
            for _ in range(400):
                if held and rng.random() < 0.5:
                    a.free(held.pop(int(rng.integers(len(held)))))
                else:
                    pages = a.alloc(int(rng.integers(1, 8)))
                    if pages is not None:
                        held.append(pages)
                        seen[i].extend(pages.tolist())
            for pages in held:
                a.free(pages)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert a.available() == 256
    assert a.allocated_pages().size == 0
    assert sum(len(s) for s in seen) > 0


def test_first_repeat_of_a_small_list_is_the_sorted_arrays() -> None:
    """Small batches are checked on a Python list; both ways name the smallest repeated page."""
    rng = np.random.default_rng(0)
    for n in (2, 3, 8, SMALL_BATCH, SMALL_BATCH + 1, 300):
        for _ in range(200):
            pages = rng.integers(0, 2 * n, size=n).astype(np.int64)
            ordered = np.sort(pages)
            repeats = ordered[1:][ordered[1:] == ordered[:-1]]
            expected = int(repeats[0]) if len(repeats) else None
            assert first_repeat(pages) == expected
            assert first_repeat_of(pages.tolist()) == expected


@pytest.mark.parametrize("n", [3, SMALL_BATCH, SMALL_BATCH + 1, 200])
def test_a_free_with_repeats_names_the_smallest_repeated_page_and_changes_nothing(n: int) -> None:
    alloc = PageAllocator(400)
    pages = alloc.alloc(n)
    assert pages is not None
    bad = np.concatenate([pages[::-1], pages[n // 2 : n // 2 + 1], pages[1:2]])
    with pytest.raises(InvalidArgument, match=f"page {int(pages[1])} is listed more than once"):
        alloc.free(bad)
    assert alloc.available() == 400 - n and alloc.is_allocated(pages).all()
