"""A page comes back unzeroed only to the session whose bytes alone it holds: a call that was to
fill new pages whole and failed part-way frees them as anyone's, since what it did not reach is
an earlier owner's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hicached.l2.group import PoolTransfer

from .conftest import Core

MARK = 0x5A


class CopyFailed(RuntimeError):
    pass


@pytest.mark.parametrize("call", ["write", "put_pages"])
def test_pages_a_failed_fill_freed_come_back_zeroed_to_its_own_session(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    c = make_core()
    a, b = c.attach("a", derived=False), c.attach("b", derived=False)
    _, state = c.core.session_group(b)
    kv = state.pool("kv")
    theirs = c.core.alloc(b, "", "kv", 4)
    assert theirs is not None
    for page in theirs.tolist():
        kv.set_page_flat(page, bytes([MARK]) * kv.page_bytes)  # b's KV
    assert c.core.free(b, "", "kv", theirs) == 4

    def copy_nothing(*args: Any, **kwargs: Any) -> None:
        raise CopyFailed("the copy failed before its first byte")

    monkeypatch.setattr(c.core.data, "copy_pages", copy_nothing)
    device = np.arange(4, dtype=np.int64)
    with pytest.raises(CopyFailed):
        if call == "write":
            c.core.write(a, "", [PoolTransfer("kv", device)], allocate=True)
        else:
            both = [PoolTransfer("kv", device), PoolTransfer("swa", device)]  # keyed: every pool
            c.keyed.put_pages(a, "", [f"k{i}" for i in range(4)], both)
    monkeypatch.undo()
    assert c.owned(a) == 0
    mine = c.core.alloc(a, "", "kv", 4)
    assert mine is not None and sorted(mine.tolist()) == sorted(theirs.tolist())  # the same pages
    for page in mine.tolist():
        assert not kv.get_page_flat(page).numpy().any(), f"page {page} holds b's bytes"
