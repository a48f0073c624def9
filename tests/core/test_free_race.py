"""A Free of a page while the page's Write or Load is between its ownership check and its
in-flight mark (the copy's planning): the page may go to another session meanwhile, and the
copy must not touch it. In process, with the planning held open by a gate."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hicached.core import dataplane
from hicached.errors import HiCacheError
from hicached.l2.group import PoolTransfer

from .conftest import PAGE_SIZE, Core


def _fill(c: Core, pages: list[int], value: float) -> None:
    for t in (*c.device["kv"].k, *c.device["kv"].v):
        for p in pages:
            t[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] = value


def _holds(c: Core, pages: list[int], value: float) -> bool:
    return all(
        bool((t[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] == value).all())
        for t in (*c.device["kv"].k, *c.device["kv"].v)
        for p in pages
    )


def test_a_page_freed_while_its_write_is_planned_is_not_written(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_core()
    a, b = c.attach("a", derived=False), c.attach("b", derived=False)
    pages = c.core.alloc(a, "", "kv", 2)
    assert pages is not None
    entered, gate = threading.Event(), threading.Event()
    plan = dataplane.build_plan

    def gated(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "late-writer":
            entered.set()
            assert gate.wait(10)
        return plan(*args, **kwargs)

    monkeypatch.setattr(dataplane, "build_plan", gated)
    _fill(c, [0, 1], 1.0)  # a's device pages
    _fill(c, [10, 11], 2.0)  # b's
    outcome: list[object] = []

    def write() -> None:
        try:
            outcome.append(c.core.write(a, "", [PoolTransfer("kv", np.array([0, 1]), pages)], allocate=False))
        except HiCacheError as exc:
            outcome.append(exc)

    writer = threading.Thread(target=write, name="late-writer")
    writer.start()
    assert entered.wait(10)  # a's write checked its pages and is planning its copy
    assert c.core.free(a, "", "kv", pages) == 2
    theirs = c.core.alloc(b, "", "kv", 2)
    assert theirs is not None and sorted(theirs.tolist()) == sorted(pages.tolist())  # the same pages
    c.core.write(b, "", [PoolTransfer("kv", np.array([10, 11]), theirs)], allocate=False)
    gate.set()
    writer.join(10)
    assert isinstance(outcome[0], HiCacheError) and "not owned by session" in str(outcome[0])
    c.core.load(b, "", [PoolTransfer("kv", np.array([20, 21]), theirs)])
    assert _holds(c, [20, 21], 2.0)  # b's bytes, not a's


@pytest.mark.parametrize("op", ["write", "load"])
def test_a_call_on_another_sessions_pages_is_refused_before_it_marks_them_in_flight(
    make_core: Callable[..., Core], monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """A stranger's Write or Load of pages it does not own must not defer their owner's Free:
    the owner frees them while the stranger's call is at its first ownership check, and they
    are free at once. Fails when the only check is the one after the in-flight mark (the
    owner's Free then returned 0 and the pages stayed allocated until the refusal)."""
    c = make_core()
    a, b = c.attach("a", derived=False), c.attach("b", derived=False)
    pages = c.core.alloc(a, "", "kv", 2)
    assert pages is not None
    check = dataplane.check_owned
    freed: list[int] = []

    def owner_frees_first(session: Any, state: Any, transfers: Any) -> None:
        if session.session_id == b and not freed:
            freed.append(c.core.free(a, "", "kv", pages))
        check(session, state, transfers)

    monkeypatch.setattr(dataplane, "check_owned", owner_frees_first)
    stolen = [PoolTransfer("kv", np.array([0, 1], dtype=np.int64), pages)]
    with pytest.raises(HiCacheError):
        if op == "write":
            c.core.write(b, "", stolen, allocate=False)
        else:
            c.core.load(b, "", stolen)
    assert freed == [2]
