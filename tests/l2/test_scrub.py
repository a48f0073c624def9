"""A page handed out holds no earlier owner's bytes: freed pages are zeroed at their next
allocation (in the pool and every pool derived from it), unless the caller overwrites them
whole (``fills``, ``copy_in``); a pool's first use and re-zeroing are skipped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hicached.errors import FailedPrecondition
from hicached.l2 import HostKVPool, HostLayout, HostPoolGroup, PoolEntry, PoolTransfer, open_host_pool

from .conftest import mha_spec, mla_spec

MakePool = Callable[..., HostKVPool]
MARK = 0x5A


def _fill(pool: HostKVPool, pages: np.ndarray, value: int = MARK) -> None:
    for page in pages.tolist():
        pool.set_page_flat(page, bytes([value]) * pool.page_bytes)


def _is(pool: HostKVPool, page: int, value: int) -> bool:
    return bool((pool.get_page_flat(page).numpy() == value).all())


@pytest.mark.parametrize("layout", list(HostLayout))
def test_zero_pages_zeroes_exactly_those_pages(make_pool: MakePool, layout: HostLayout) -> None:
    pool = make_pool(mha_spec(layers=3), layout=layout, num_pages=6)
    everything = np.arange(6, dtype=np.int64)
    _fill(pool, everything)
    pool.zero_pages(np.array([1, 4], dtype=np.int64))
    assert [_is(pool, p, 0) for p in range(6)] == [False, True, False, False, True, False]
    assert [_is(pool, p, MARK) for p in range(6)] == [True, False, True, True, False, True]


@pytest.fixture
def group(make_pool: MakePool) -> HostPoolGroup:
    """kv (anchor) with a derived pool, and a second independent pool."""
    return HostPoolGroup(
        [
            PoolEntry("kv", make_pool(mla_spec(), num_pages=4), is_primary_index_anchor=True),
            PoolEntry("draft", make_pool(num_pages=4, layout=HostLayout.LAYER_FIRST), indices_from_pool="kv"),
            PoolEntry("swa", make_pool(num_pages=4)),
        ]
    )


def _used(group: HostPoolGroup) -> np.ndarray:
    """Every kv page written by an owner (kv and its derived pool), then freed."""
    got = group.allocate({"kv": 4})
    assert got.ok
    pages = got.pages["kv"]
    _fill(group.get_pool("kv"), pages)
    _fill(group.get_pool("draft"), pages)
    group.free(pages, pool="kv")
    return pages


def test_a_freed_page_comes_back_zeroed_in_its_pool_and_the_derived_ones(group: HostPoolGroup) -> None:
    _used(group)
    got = group.allocate({"kv": 4})
    assert got.ok
    for page in got.pages["kv"].tolist():
        assert _is(group.get_pool("kv"), page, 0) and _is(group.get_pool("draft"), page, 0)


def test_pools_the_caller_fills_are_not_zeroed_and_the_rest_are(group: HostPoolGroup) -> None:
    _used(group)
    got = group.allocate({"kv": 4}, fills={"kv"})
    for page in got.pages["kv"].tolist():
        assert _is(group.get_pool("kv"), page, MARK)  # the caller overwrites these itself
        assert _is(group.get_pool("draft"), page, 0)  # nobody writes these: zeroed


def test_a_page_once_zeroed_is_not_zeroed_again_until_freed(group: HostPoolGroup) -> None:
    pages = _used(group)
    got = group.allocate({"kv": 4})
    _fill(group.get_pool("kv"), got.pages["kv"], 7)  # the new owner's bytes stay its own
    assert group.get_pool("kv").allocator.take_dirty(got.pages["kv"]).size == 0
    group.free(pages, pool="kv")
    assert group.get_pool("kv").allocator.take_dirty(pages).size == 4


def test_a_page_its_owner_freed_comes_back_to_that_owner_as_it_was(group: HostPoolGroup) -> None:
    kv, draft = group.get_pool("kv"), group.get_pool("draft")
    pages = group.allocate({"kv": 4}, owner=7).pages["kv"]
    _fill(kv, pages)
    _fill(draft, pages)
    group.free(pages, pool="kv", by=7)
    mine = group.allocate({"kv": 4}, owner=7).pages["kv"]
    assert sorted(mine.tolist()) == sorted(pages.tolist())
    assert all(_is(kv, p, MARK) and _is(draft, p, MARK) for p in mine.tolist())  # not zeroed
    group.free(mine, pool="kv", by=7)
    theirs = group.allocate({"kv": 4}, owner=8).pages["kv"]  # another owner: zeroed
    assert all(_is(kv, p, 0) and _is(draft, p, 0) for p in theirs.tolist())


@pytest.mark.parametrize("freed_by", [None, 8])
@pytest.mark.parametrize("taken_by", [None, 7])
def test_a_page_freed_by_anyone_else_is_zeroed_for_every_owner(
    group: HostPoolGroup, freed_by: int | None, taken_by: int | None
) -> None:
    """Freed by another owner or by nobody in particular (the index, a teardown), or taken
    without an owner: zeroed."""
    kv = group.get_pool("kv")
    pages = group.allocate({"kv": 4}, owner=8).pages["kv"]
    _fill(kv, pages)
    if freed_by is None:
        group.free(pages, pool="kv")
    else:
        group.free(pages, pool="kv", by=freed_by)
    got = group.allocate({"kv": 4}) if taken_by is None else group.allocate({"kv": 4}, owner=taken_by)
    assert all(_is(kv, p, 0) for p in got.pages["kv"].tolist())


@pytest.mark.parametrize("copy_in", [False, True])
def test_resolve_zeroes_what_no_copy_will_write(group: HostPoolGroup, copy_in: bool) -> None:
    _used(group)
    result = group.resolve_all([PoolTransfer("kv", np.arange(4, dtype=np.int64))], copy_in=copy_in)
    assert result.ok
    pages = result.transfers[0].host_indices
    assert pages is not None
    for page in pages.tolist():
        assert _is(group.get_pool("kv"), page, MARK if copy_in else 0)
        assert _is(group.get_pool("draft"), page, 0)  # no transfer names it: zeroed either way


def test_a_remapped_pool_zeroes_what_the_last_daemon_left(make_pool: MakePool) -> None:
    pool = make_pool(mha_spec(), num_pages=4)
    everything = np.arange(4, dtype=np.int64)
    _fill(pool, everything)
    again = open_host_pool(pool.spec, pool.layout, 4, segment_name=pool.segment.name)
    try:
        group = HostPoolGroup([PoolEntry("kv", again)])
        got = group.allocate({"kv": 4})
        assert all(_is(again, p, 0) for p in got.pages["kv"].tolist())
    finally:
        again.close()


def test_a_closed_pool_is_unmapped_and_refuses_zeroing(make_pool: MakePool) -> None:
    pool = make_pool(mha_spec(), num_pages=4)
    name = pool.segment.name
    pool.close()
    with pytest.raises(FailedPrecondition, match="closed"):
        pool.zero_pages(np.array([0], dtype=np.int64))
    # The page view zero_pages keeps must not keep the segment mapped after close.
    assert name not in Path("/proc/self/maps").read_text()


def test_a_failed_zeroing_frees_the_pages_it_was_handed(
    group: HostPoolGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = _used(group)
    available = group.available("kv")

    def broken(_pages: np.ndarray) -> None:
        raise FailedPrecondition("pool segment is mapped read-only")

    monkeypatch.setattr(group.get_pool("draft"), "zero_pages", broken)
    with pytest.raises(FailedPrecondition):
        group.allocate({"kv": 4})
    assert group.available("kv") == available  # nothing leaked
    monkeypatch.undo()
    got = group.allocate({"kv": 4})  # still flagged: zeroed now
    assert sorted(got.pages["kv"].tolist()) == sorted(pages.tolist())
    assert all(_is(group.get_pool("draft"), p, 0) for p in pages.tolist())
