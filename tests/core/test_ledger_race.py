"""Two operations of one session that give away the same host pages, or one that gives pages
away while another is handed them back: a session's ledger must end up owning exactly what it
holds, and no call may free pages another session has been given since. In process, with the
racy order driven by a gate (two threads) or by a wrapper that runs the other call in between."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hicached.core import dataplane
from hicached.errors import HiCacheError, PermissionDenied
from hicached.l2.group import PoolTransfer

from .conftest import Core


def test_a_second_free_of_the_same_pages_cannot_free_what_another_session_got_since(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: both Frees passed the ownership check, and the second freed the
    pages the first had freed and session b had allocated since (b's pages back on the stack)."""
    c = make_core()
    a, b = c.attach("a", derived=False), c.attach("b", derived=False)
    pages = c.core.alloc(a, "", "kv", 2)
    assert pages is not None
    checked, gate = threading.Event(), threading.Event()
    check = dataplane.check_owned

    def gated(*args: Any, **kwargs: Any) -> None:
        check(*args, **kwargs)
        if threading.current_thread().name == "second-free":
            checked.set()
            assert gate.wait(10)

    monkeypatch.setattr(dataplane, "check_owned", gated)
    outcome: list[object] = []

    def second() -> None:
        try:
            outcome.append(c.core.free(a, "second", "kv", pages))
        except HiCacheError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=second, name="second-free")
    thread.start()
    assert checked.wait(10)  # the second Free found a owning the pages
    assert c.core.free(a, "first", "kv", pages) == 2
    theirs = c.core.alloc(b, "", "kv", 2)
    assert theirs is not None and sorted(theirs.tolist()) == sorted(pages.tolist())
    gate.set()
    thread.join(10)
    assert isinstance(outcome[0], PermissionDenied), outcome
    _, state = c.core.session_group(b)
    assert state.pool("kv").allocator.is_allocated(theirs).all()  # b's pages are still b's
    assert c.owned(a) == 0 and c.owned(b) == 2
    assert c.core.free(b, "", "kv", theirs) == 2


def test_a_free_racing_an_alloc_of_the_same_session_keeps_the_new_pages_owned(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: the Free forgot the pages after freeing them, so the pages the
    Alloc got back in between were allocated but owned by nobody (never freed at detach)."""
    c = make_core()
    a = c.attach("a", derived=False)
    before = c.pools(a)
    pages = c.core.alloc(a, "", "kv", 2)
    assert pages is not None
    _, state = c.core.session_group(a)
    real_free = state.free
    again: list[np.ndarray] = []

    def free_then_alloc(name: str, arr: np.ndarray, *, by: int) -> int:
        freed = real_free(name, arr, by=by)
        got = c.core.alloc(a, "", "kv", 2)  # another thread of the session, between free and forget
        assert got is not None
        again.append(got)
        return freed

    monkeypatch.setattr(state, "free", free_then_alloc)
    assert c.core.free(a, "", "kv", pages) == 2
    monkeypatch.undo()
    assert sorted(again[0].tolist()) == sorted(pages.tolist())  # the same pages, given back
    assert c.owned(a) == 2
    assert c.core.detach(a) == 2
    assert c.pools(c.attach("a2", derived=False)) == before


def test_a_release_racing_an_alloc_of_the_same_session_keeps_the_new_pages_owned(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above for ReleaseTransfers (and every path that releases a session's pages)."""
    c = make_core()
    a = c.attach("a", derived=False)
    before = c.pools(a)
    got = c.core.resolve(a, "", [PoolTransfer("kv", np.arange(2))])
    assert got.ok
    _, state = c.core.session_group(a)
    real = state.release_transfers
    again: list[np.ndarray] = []

    def release_then_alloc(transfers: Any, *, by: int) -> int:
        freed = real(transfers, by=by)
        pages = c.core.alloc(a, "", "kv", 2)
        assert pages is not None
        again.append(pages)
        return freed

    monkeypatch.setattr(state, "release_transfers", release_then_alloc)
    assert c.core.release(a, "", list(got.transfers)) == 2
    monkeypatch.undo()
    assert c.owned(a) == 2
    assert c.core.detach(a) == 2
    assert c.pools(c.attach("a2", derived=False)) == before


def _clear_and_alloc_after_publish(c: Core, sid: str, monkeypatch: pytest.MonkeyPatch) -> list[np.ndarray]:
    """Make the index's publish clear the namespace (freeing the new entries' pages at once)
    and the session allocate 2 kv pages before the publishing call goes on."""
    _, state = c.core.session_group(sid)
    index = state.index
    assert index is not None
    real = index.publish
    again: list[np.ndarray] = []

    def publish_then_clear(*args: Any, **kwargs: Any) -> np.ndarray:
        mask = real(*args, **kwargs)
        index.clear()
        pages = c.core.alloc(sid, "", "kv", 2)
        assert pages is not None
        again.append(pages)
        return mask

    monkeypatch.setattr(index, "publish", publish_then_clear)
    return again


def test_pages_published_cleared_and_allocated_again_stay_owned(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: Publish forgot its pages after the index took them; a clear (or an
    eviction) in between freed them and the session's next Alloc got them, then lost them."""
    c = make_core()
    a = c.attach("a", derived=False)
    before = c.pools(a)
    kv = c.core.alloc(a, "", "kv", 2)
    swa = c.core.alloc(a, "", "swa", 2)
    assert kv is not None and swa is not None
    again = _clear_and_alloc_after_publish(c, a, monkeypatch)
    transfers = [PoolTransfer("kv", None, kv), PoolTransfer("swa", None, swa)]
    assert c.keyed.publish(a, "", ["k0", "k1"], transfers) == (2, 0)
    monkeypatch.undo()
    assert sorted(again[0].tolist()) == sorted(kv.tolist())
    assert c.owned(a) == 2
    assert c.core.detach(a) == 2
    assert c.pools(c.attach("a2", derived=False)) == before


def test_put_pages_whose_pages_are_cleared_and_allocated_again_keeps_them_owned(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above for PutPages (its pages published, then cleared, then this session's)."""
    c = make_core()
    a = c.attach("a", derived=False)
    before = c.pools(a)
    again = _clear_and_alloc_after_publish(c, a, monkeypatch)
    transfers = [PoolTransfer("kv", np.arange(2)), PoolTransfer("swa", np.arange(2))]
    assert c.keyed.put_pages(a, "", ["k0", "k1"], transfers).stored_pages == 2
    monkeypatch.undo()
    assert len(again[0]) == 2 and c.owned(a) == 2
    assert c.core.detach(a) == 2
    assert c.pools(c.attach("a2", derived=False)) == before
