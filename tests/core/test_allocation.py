"""One allocation path: nothing is evicted unless the whole request then fits, so a failed
call leaves the pools and the content index exactly as they were. In-process core."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hicached.errors import InvalidArgument, ResourceExhausted
from hicached.l2.group import PoolTransfer
from tests.core.conftest import Core, pages


def _fill_index(c: Core, sid: str, n: int, prefix: str = "k") -> None:
    c.put(sid, [f"{prefix}{i}" for i in range(n)])


def test_a_put_bytes_that_cannot_fit_evicts_nothing(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: the PutBytes evicted the published pages first (index 2 -> 0)
    and then failed with RESOURCE_EXHAUSTED."""
    c = make_core()
    sid = c.attach(derived=False)
    total = c.pools(sid)["kv"][1]
    _fill_index(c, sid, 2)
    before = c.pools(sid)
    _, state = c.core.session_group(sid)
    big = [(f"n{i}", p, b"\x01" * state.pool(p).page_bytes) for i in range(total + 1) for p in ("kv", "swa")]
    with pytest.raises(ResourceExhausted, match="no room"):
        c.keyed.put_bytes(sid, "", big)
    assert c.indexed(sid) == 2 and c.pools(sid) == before


def test_an_alloc_that_cannot_fit_evicts_nothing(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: Alloc reclaimed the shortfall (evicting every cached page) before
    learning that the request could not fit anyway."""
    c = make_core()
    sid = c.attach()
    total = c.pools(sid)["kv"][1]
    _fill_index(c, sid, 3)
    held = c.core.alloc(sid, "", "kv", total - 4)  # 1 page free, 3 reclaimable
    assert held is not None
    before = c.pools(sid)
    assert c.core.alloc(sid, "", "kv", 5) is None
    assert c.indexed(sid) == 3 and c.pools(sid) == before
    got = c.core.alloc(sid, "", "kv", 3)  # fits after evicting exactly the shortfall (2)
    assert got is not None and c.indexed(sid) == 1


def test_a_resolve_whose_sidecar_cannot_fit_evicts_nothing(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: the anchor was allocated first, then the sidecar's reclaim evicted
    the cache, then the sidecar still did not fit and the call failed (index 2 -> 0)."""
    c = make_core()
    sid = c.attach()
    total = c.pools(sid)["swa"][1]
    _fill_index(c, sid, 2)
    held = c.core.alloc(sid, "", "swa", total - 2)  # swa: 0 free, 2 reclaimable; kv has room
    assert held is not None
    before = c.pools(sid)
    batch = [PoolTransfer("kv", pages(range(3))), PoolTransfer("swa", pages(range(3))), PoolTransfer("draft")]
    result = c.core.resolve(sid, "", batch)
    assert not result.ok
    assert c.indexed(sid) == 2 and c.pools(sid) == before
    result = c.core.resolve(sid, "", [*batch[:1], PoolTransfer("swa", pages(range(2))), *batch[2:]])
    assert result.ok and c.indexed(sid) == 0  # two pages fit after evicting both entries


def test_prefetch_rows_and_put_pages_share_the_path(make_core: Callable[..., Core]) -> None:
    """PutPages allocates through the same path: a batch larger than free + reclaimable
    answers ok=False and evicts nothing."""
    c = make_core()
    sid = c.attach()
    total = c.pools(sid)["kv"][1]
    _fill_index(c, sid, 2)
    held = c.core.alloc(sid, "", "kv", total - 2)
    assert held is not None
    before = c.pools(sid)
    keys = [f"p{i}" for i in range(3)]
    batch = [PoolTransfer("kv", pages(range(3))), PoolTransfer("swa", pages(range(3))), PoolTransfer("draft")]
    result = c.keyed.put_pages(sid, "", keys, batch)
    assert not result.ok and c.indexed(sid) == 2 and c.pools(sid) == before


def test_a_put_allocates_only_for_the_keys_the_index_lacks(make_core: Callable[..., Core]) -> None:
    """A cached key anywhere in the list takes no host page (before: only a leading run was
    skipped; the put evicted the one entry it could to make room for a copy it then threw away)."""
    c = make_core()
    sid = c.attach()
    total = c.pools(sid)["kv"][1]
    _fill_index(c, sid, 2)  # k0, k1
    held = c.core.alloc(sid, "", "kv", total - 4)  # kv: 2 free, 2 reclaimable
    assert held is not None
    batch = [PoolTransfer("kv", pages(range(3))), PoolTransfer("swa", pages(range(3))), PoolTransfer("draft")]
    result = c.keyed.put_pages(sid, "", ["p0", "k0", "p1"], batch)
    assert (result.ok, result.stored_pages, result.existing_pages) == (True, 2, 1)
    assert c.indexed(sid) == 4  # k0 and k1 stay


@pytest.mark.parametrize("call", ["put", "get"])
def test_a_keyed_call_whose_derived_pool_names_another_page_count_is_refused(
    make_core: Callable[..., Core], call: str
) -> None:
    c = make_core()
    sid = c.attach()
    _fill_index(c, sid, 3, prefix="p")
    before = c.pools(sid)
    batch = [
        PoolTransfer("kv", pages(range(3))),
        PoolTransfer("swa", pages(range(3))),
        PoolTransfer("draft", pages(range(2))),
    ]
    with pytest.raises(InvalidArgument, match="'draft': 2 device pages for 3 keys"):
        if call == "put":
            c.keyed.put_pages(sid, "", ["n0", "n1", "n2"], batch)
        else:
            c.keyed.get_pages(sid, "", ["p0", "p1", "p2"], batch, include_l3=False)
    assert c.indexed(sid) == 3 and c.pools(sid) == before
