"""A session's record of its prefetches stays bounded however often it calls Prefetch."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hicached.errors import NotFound

from .conftest import Core


def test_a_session_keeps_only_the_prefetch_ids_the_index_keeps(make_core: Callable[..., Core]) -> None:
    """The index keeps its last 1,024 finished prefetches; the session's own set of ids
    followed every call (1,100 calls: 1,100 ids, growing without bound for a client that
    prefetches forever). Now it holds what the index keeps, and an id the index forgot
    answers NotFound as before."""
    c = make_core()
    sid = c.attach()
    ids = [c.keyed.prefetch(sid, [f"k{i}"], policy=None, timeout_ms=0)[0] for i in range(1100)]
    session = c.core._sessions.get(sid)
    assert ids[-1] in session.prefetches and ids[0] not in session.prefetches
    assert len(session.prefetches) == 1024
    assert c.keyed.prefetch_status(sid, ids[-1], wait=False) is not None
    with pytest.raises(NotFound):
        c.keyed.prefetch_status(sid, ids[0], wait=False)
