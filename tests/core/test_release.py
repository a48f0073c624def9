"""ReleaseTransfers validates the whole batch first and skips derived entries by their role."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from hicached.errors import DoubleFree, PermissionDenied
from hicached.l2.group import PoolTransfer
from tests.core.conftest import Core, pages


def _resolved(c: Core, sid: str) -> list[PoolTransfer]:
    batch = [PoolTransfer("kv", pages(range(3))), PoolTransfer("swa", pages(range(3))), PoolTransfer("draft")]
    result = c.core.resolve(sid, "", batch)
    assert result.ok
    return list(result.transfers)


@pytest.mark.parametrize("derived_first", [True, False])
def test_a_derived_transfer_marked_host_allocated_is_skipped(
    make_core: Callable[..., Core], derived_first: bool
) -> None:
    """Fails before the fix: listed first, the call failed with FAILED_PRECONDITION after
    dropping the session's ownership of kv's pages (a leak); listed second, it freed kv's
    pages and still failed."""
    c = make_core()
    sid = c.attach()
    before = c.pools(sid)
    got = {t.name: t for t in _resolved(c, sid)}
    draft = replace(got["draft"], host_allocated=True)
    rest = [got["kv"], got["swa"]]
    batch = [draft, *rest] if derived_first else [*rest, draft]
    assert c.core.release(sid, "", batch) == 6
    assert c.pools(sid) == before and c.owned(sid) == 0


def test_a_release_with_one_bad_entry_frees_nothing(make_core: Callable[..., Core]) -> None:
    c = make_core()
    sid = c.attach()
    other = c.attach("other")
    got = {t.name: t for t in _resolved(c, sid)}
    theirs = {t.name: t for t in _resolved(c, other)}
    before, owned = c.pools(sid), c.owned(sid)
    with pytest.raises(PermissionDenied):
        c.core.release(sid, "", [got["kv"], theirs["swa"]])
    assert c.pools(sid) == before and c.owned(sid) == owned
    assert c.core.release(sid, "", [got["kv"], got["swa"]]) == 6
    with pytest.raises(DoubleFree):
        c.core.release(sid, "", [got["kv"]])
