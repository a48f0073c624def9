"""A Free of an anchor page while a copy of its derived pool (only) is running: the derived
pool's page at that index is the anchor page's owner's, so the free must wait for the copy,
as it does for the anchor's own copies (tests/core/test_free_race.py). In process, with the
copy held open by a gate."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hicached.l2.group import PoolTransfer

from .conftest import PAGE_SIZE, Core


def _fill(c: Core, pool: str, pages: list[int], value: float) -> None:
    for t in (*c.device[pool].k, *c.device[pool].v):
        for p in pages:
            t[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] = value


def _holds(c: Core, pool: str, pages: list[int], value: float) -> bool:
    return all(
        bool((t[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] == value).all())
        for t in (*c.device[pool].k, *c.device[pool].v)
        for p in pages
    )


def test_an_anchor_page_freed_during_a_derived_write_is_not_given_to_another_session(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: the copy marked its pages in flight under the derived pool's name,
    so the Free of the anchor's pages freed them at once, session b was given them, and a's
    late draft bytes landed in b's draft pages."""
    c = make_core()
    a, b = c.attach("a"), c.attach("b")
    pages = c.core.alloc(a, "", "kv", 2)
    assert pages is not None
    entered, gate = threading.Event(), threading.Event()
    engine = c.core.engine
    run = engine.run

    def gated(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "late-writer":
            entered.set()
            assert gate.wait(10)
        return run(*args, **kwargs)

    monkeypatch.setattr(engine, "run", gated)
    _fill(c, "draft", [0, 1], 1.0)  # a's device draft pages
    _fill(c, "draft", [10, 11], 2.0)  # b's
    done: list[object] = []

    def write() -> None:
        done.append(c.core.write(a, "", [PoolTransfer("draft", np.array([0, 1]), pages)], allocate=False))

    writer = threading.Thread(target=write, name="late-writer")
    writer.start()
    assert entered.wait(10)  # a's draft write is copying into the pages' draft half
    c.core.free(a, "", "kv", pages)
    theirs = c.core.alloc(b, "", "kv", 2)
    assert theirs is not None
    c.core.write(b, "", [PoolTransfer("draft", np.array([10, 11]), theirs)], allocate=False)
    gate.set()
    writer.join(10)
    assert done and done[0].ok  # type: ignore[attr-defined]
    c.core.load(b, "", [PoolTransfer("draft", np.array([20, 21]), theirs)])
    assert _holds(c, "draft", [20, 21], 2.0)  # b's bytes, not a's
    _, state = c.core.session_group(a)
    assert not state.pool("kv").allocator.is_allocated(pages[~np.isin(pages, theirs)]).any()
