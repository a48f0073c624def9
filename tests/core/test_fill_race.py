"""Pages a Write with allocate (or a PutPages) fills are not the session's until the copy filled
them: until then they may hold an earlier owner's bytes (a call that overwrites pages whole does
not zero them first). Found by a review: a Free or Publish of the same session that ran between
the allocation and the copy's in-flight mark passed the ownership check, so a Free handed
another owner's bytes back to the session unzeroed (its own freed pages are not zeroed since
04666ba), and a Publish put another tenant's bytes under the session's keys (older: it failed on
af38862 too). In process; the racing call runs on another thread inside the window."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hicached.errors import HiCacheError, PermissionDenied
from hicached.l2.group import PoolTransfer

from .conftest import Core

MARK = 0x5A
POOLS = ("kv", "swa")


def _leave_bytes(c: Core, session: str) -> None:
    """Two pages of each pool written by ``session`` and freed (its bytes stay in them)."""
    _, state = c.core.session_group(session)
    for pool in POOLS:
        host = state.pool(pool)
        pages = c.core.alloc(session, "", pool, 2)
        assert pages is not None
        for page in pages.tolist():
            host.set_page_flat(page, bytes([MARK]) * host.page_bytes)
        assert c.core.free(session, "", pool, pages) == 2


def _in_the_window(
    c: Core, monkeypatch: pytest.MonkeyPatch, racer: Callable[[list[PoolTransfer]], object]
) -> list[object]:
    """Run ``racer`` (given the copy's transfers) on another thread just before the first copy."""
    real = type(c.core.data).copy_pages
    outcome: list[object] = []

    def copy_pages(self: Any, session: Any, state: Any, direction: Any, transfers: Any, **kw: Any) -> Any:
        if not outcome:

            def race() -> None:
                try:
                    outcome.append(racer(list(transfers)))
                except HiCacheError as exc:
                    outcome.append(exc)

            thread = threading.Thread(target=race)
            thread.start()
            thread.join(30)
        return real(self, session, state, direction, transfers, **kw)

    monkeypatch.setattr(type(c.core.data), "copy_pages", copy_pages)
    return outcome


def test_a_free_of_pages_a_write_is_filling_is_refused(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_core()
    a, b = c.attach("a", derived=False), c.attach("b", derived=False)
    _leave_bytes(c, b)
    kv_pages = lambda ts: next(t.host_indices for t in ts if t.name == "kv")  # noqa: E731
    outcome = _in_the_window(c, monkeypatch, lambda ts: c.core.free(a, "", "kv", kv_pages(ts)))
    dev = np.arange(2, dtype=np.int64)
    written = c.core.write(a, "", [PoolTransfer("kv", dev)], allocate=True)
    monkeypatch.undo()
    assert written.ok
    assert isinstance(outcome[0], PermissionDenied), outcome  # before: 2 (freed under the copy)
    _, state = c.core.session_group(a)
    kv = state.pool("kv")
    host = written.transfers[0].host_indices
    assert host is not None and c.owned(a) == 2  # the Write's pages, the session's once filled
    assert c.core.free(a, "", "kv", host) == 2
    again = c.core.alloc(a, "", "kv", 2)
    assert again is not None
    assert not any(bytes(kv.get_page_flat(p).numpy()).count(MARK) for p in again.tolist())


def test_a_publish_of_pages_a_write_is_filling_is_refused(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_core()
    a = c.attach("a", derived=False, tenant="team-a")
    b = c.attach("b", derived=False, tenant="team-b")
    _leave_bytes(c, b)
    keys = ["k0", "k1"]
    outcome = _in_the_window(
        c,
        monkeypatch,
        lambda ts: c.keyed.publish(
            a, "", keys, [PoolTransfer(t.name, host_indices=t.host_indices) for t in ts]
        ),
    )
    dev = np.arange(2, dtype=np.int64)
    written = c.core.write(a, "", [PoolTransfer(p, dev) for p in POOLS], allocate=True)
    monkeypatch.undo()
    assert written.ok
    assert isinstance(outcome[0], PermissionDenied), outcome  # before: (2, 0), published
    _, found = c.keyed.get_bytes(a, keys, include_l3=False)
    assert not [key for key, _, data in found if bytes(data).count(MARK)], (
        "team-b's bytes under team-a's keys"
    )
