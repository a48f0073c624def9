"""A worker's GetStats that names no session sees the daemon's aggregates only, and the core
builds nothing more for it (a review, stop 41: it built every session's and group's stats,
on the event loop, for the servicer to drop them: ~40 ms a call with 256 sessions)."""

from __future__ import annotations

from collections.abc import Callable

from tests.core.conftest import Core


def test_a_workers_view_without_a_session_is_the_aggregates_only(make_core: Callable[..., Core]) -> None:
    c = make_core()
    sid = c.attach(derived=False)
    full = c.core.stats()
    assert len(full.sessions) == 1 and len(full.groups) == 1
    worker = c.core.stats(own=True)
    assert (worker.sessions, worker.groups, worker.backups) == ((), (), ())
    assert (worker.host_budget_bytes, worker.host_used_bytes, worker.draining) == (
        full.host_budget_bytes,
        full.host_used_bytes,
        full.draining,
    )
    mine = c.core.stats(sid, own=True)
    assert [s.session_id for s in mine.sessions] == [sid] and len(mine.groups) == 1
