"""Publish ranges, page batches and group joins are validated before anything changes."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from hicached.core.checks import check_indices
from hicached.errors import FailedPrecondition, InvalidArgument, OutOfRange
from hicached.l2.group import PoolTransfer
from tests.core.conftest import Core, pages


@pytest.mark.parametrize(("page", "error"), [(10**6, OutOfRange), (-1, InvalidArgument)])
def test_publish_of_a_host_page_out_of_range_is_precise_and_changes_nothing(
    make_core: Callable[..., Core], page: int, error: type[Exception]
) -> None:
    """Fails before the fix: an out-of-range page was an IndexError (INTERNAL) and a negative
    page wrapped around and tested the pool's last page."""
    c = make_core()
    sid = c.attach()
    held = c.core.alloc(sid, "", "swa", 1)
    assert held is not None
    before, owned = c.pools(sid), c.owned(sid)
    batch = [PoolTransfer("kv", host_indices=pages([page])), PoolTransfer("swa", host_indices=held)]
    with pytest.raises(error, match="host page"):
        c.keyed.publish(sid, "", ["key"], batch)
    assert c.pools(sid) == before and c.owned(sid) == owned and c.indexed(sid) == 0


def test_a_join_with_a_nan_host_ratio_is_refused(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: a join skipped the sizing, so a NaN ratio was accepted."""
    c = make_core()
    c.attach("a")
    with pytest.raises(InvalidArgument, match="host ratio"):
        c.attach("b", ratio=math.nan)


def test_tp_rank_outside_tp_size_is_refused(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: nothing checked tp_rank against tp_size."""
    c = make_core()
    with pytest.raises(InvalidArgument, match="tp_rank=2"):
        c.attach("a", tp_rank=2, tp_size=2)


def test_duplicate_layer_ids_are_refused(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: repeated global layer ids were accepted (on a join, unchecked)."""
    c = make_core()
    c.attach("a")
    with pytest.raises(InvalidArgument, match="layer id"):
        c.attach("b", layer_ids=[1, 1])


def test_a_join_asking_for_a_larger_host_pool_is_refused_naming_both_sizes(
    make_core: Callable[..., Core],
) -> None:
    """Fails before the fix: the worker silently joined the old, smaller group."""
    c = make_core()
    first = c.attach("a", ratio=0.25)
    small = c.pools(first)["kv"][1]
    with pytest.raises(FailedPrecondition) as err:
        c.attach("b", ratio=0.5)
    assert f"with {small}" in str(err.value) and "asks for" in str(err.value)
    assert c.attach("c", ratio=0.125)  # smaller: joins
    c.core.detach(first)
    for s in c.core.stats().sessions:
        c.core.detach(s.session_id)
    bigger = c.attach("d", ratio=0.5)  # nobody left: the group is recreated at the new size
    assert c.pools(bigger)["kv"][1] > small


@pytest.mark.parametrize("n", [65, 1000])
def test_check_indices_of_a_large_batch_names_the_bad_page_in_order_or_not(n: int) -> None:
    """Above SMALL_BATCH an ascending batch is bounded by its ends and has no repeat; any
    other is checked in full. Each bad batch is refused the same way in both shapes."""
    good = np.arange(10, 10 + n, dtype=np.int64)
    for batch in (good, good[::-1].copy()):
        check_indices("kv", "host", batch, 10 + n)
    with pytest.raises(InvalidArgument, match="negative host page index -1"):
        check_indices("kv", "host", np.concatenate(([-1], good)), 10 + n)
    with pytest.raises(OutOfRange, match=f"host page {10 + n} out of range"):
        check_indices("kv", "host", np.concatenate((good, [10 + n])), 10 + n)
    with pytest.raises(OutOfRange, match=f"host page {10 + n} out of range"):
        check_indices("kv", "host", np.concatenate(([10 + n], good)), 10 + n)
    repeated = good.copy()
    repeated[n // 2] = repeated[n // 2 - 1]  # still in order, not strictly: a repeat
    with pytest.raises(InvalidArgument, match=f"duplicate host page {repeated[n // 2]}"):
        check_indices("kv", "host", repeated, 10 + n)
    with pytest.raises(InvalidArgument, match=f"duplicate host page {repeated[n // 2]}"):
        check_indices("kv", "host", repeated[::-1].copy(), 10 + n)
    check_indices("kv", "host", repeated, 10 + n, unique=False)
