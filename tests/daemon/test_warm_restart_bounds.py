"""Warm restart keeps what host.budget and host.max_groups allow, across any number of restarts.

Journaled groups (a clean shutdown's segments and journals, not yet re-created by a worker)
count against the next daemon's budget and group count: at startup the oldest are dropped
until the rest fit, and later before any idle live group is retired. Before, a journaled group
whose model never came back stayed forever and counted against nothing: with new model names
each run, six daemons of a 64 MiB, 2-group node left 12 groups, 101.5 MB of segments and 12
journals.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from hicached_client import HiCacheClient, Session, WorkerIdentity

from tests.daemon.conftest import stop_with
from tests.robustness.loop_support import byte_spec
from tests.support.daemon import Daemon
from tests.support.kv import unique_tag
from tests.support.warm import Warm

TIMEOUT_S = 30.0
RESTARTS = 4


def attach(daemon: Daemon, model: str) -> tuple[str, bool]:
    """Attach and detach one byte-only worker of ``model``: its group id, and whether it
    joined an existing (here: a journaled) group."""
    with HiCacheClient(daemon.target, timeout_s=TIMEOUT_S) as client:
        session: Session = client.attach(
            WorkerIdentity(unique_tag("w"), 1, model), [byte_spec()], heartbeat=False
        )
        gid = session.info.pools[0].segment.split("-")[1]  # <prefix>-<group id>-<pool>
        joined = session.info.joined_existing_group
        session.detach()
    return gid, joined


def on_disk(warm: Warm) -> tuple[set[str], set[str]]:
    """The group ids that have segments in /dev/shm, and those that have journals."""
    segments = {name.split("-")[1] for name in warm.segments()}
    journals = {p.name.removesuffix(".json").split("-")[1] for p in warm.journals()}
    return segments, journals


def segment_bytes(warm: Warm) -> int:
    return sum((Path("/dev/shm") / name).stat().st_size for name in warm.segments())


def test_models_that_never_return_stay_within_max_groups(warm: Warm) -> None:
    """Each daemon (host.max_groups=2) re-attaches the previous daemon's newest model (it joins
    its journaled group: warm) and one new model. The new model's group drops the oldest
    journaled one, so no more than two groups are ever on disk. Before, every daemon added one:
    3 groups after the third daemon."""
    previous: str | None = None
    for r in range(RESTARTS):
        d = warm.start_with("--set", "host.max_groups=2")
        try:
            kept: set[str] = set()
            if previous is not None:
                gid, joined = attach(d, previous)
                assert joined, f"daemon {r}: {previous}'s journaled group was not re-mapped\n{d.log}"
                kept.add(gid)
            gid, joined = attach(d, f"m-rotating-{r}")
            assert not joined
            kept.add(gid)
            segments, journals = on_disk(warm)
            assert segments == kept and not journals, (r, segments, journals, d.log)
            assert stop_with(d, signal.SIGTERM) == 0, d.log
        finally:
            d.stop()
        segments, journals = on_disk(warm)
        assert segments == journals == kept, f"after daemon {r}: segments {segments}, journals {journals}"
        previous = f"m-rotating-{r}"


@pytest.mark.parametrize("bound", ["budget", "max_groups"])
def test_at_startup_the_oldest_journaled_groups_are_dropped(warm: Warm, bound: str) -> None:
    """Three journaled groups, and a daemon whose budget (or group count) holds two: it drops
    the least recently used one at startup (logged) and re-maps the others when their workers
    attach. Before, the third stayed, counted against nothing."""
    first = warm.start()
    try:
        gids = [attach(first, model)[0] for model in ("m-old", "m-mid", "m-new")]
        assert stop_with(first, signal.SIGTERM) == 0, first.log
    finally:
        first.stop()
    assert on_disk(warm) == (set(gids), set(gids))
    each = segment_bytes(warm) // 3
    limit = (
        ("--host-budget", str(2 * each + each // 2)) if bound == "budget" else ("--set", "host.max_groups=2")
    )
    second = warm.start_with(*limit)
    try:
        segments, journals = on_disk(warm)
        assert segments == journals == set(gids[1:]), (segments, journals, second.log)
        assert f"dropped journaled pool group {gids[0]}" in second.log
        with HiCacheClient(second.admin_target, timeout_s=TIMEOUT_S) as admin:
            assert admin.get_stats().host_used_bytes == 2 * each  # journaled groups count
        assert attach(second, "m-mid") == (gids[1], True)
        assert attach(second, "m-new") == (gids[2], True)
    finally:
        second.stop()


def test_a_journal_over_its_bound_starts_its_group_cold_unread(warm: Warm) -> None:
    """A journal larger than what its group's pages can hold (docs/limits.md) is refused before
    any of it is parsed: the group starts cold, with one line naming the file and the bound.
    Before, a journal of any size was read whole and replayed (here: the worker joined its
    journaled group)."""
    first = warm.start()
    try:
        gid, _ = attach(first, "m-padded")
        assert stop_with(first, signal.SIGTERM) == 0, first.log
    finally:
        first.stop()
    (journal,) = warm.journals()
    # Still valid JSON (whitespace), 8 MiB: over the bound of 64 pages (~0.3 MB).
    journal.write_bytes(journal.read_bytes() + b" " * (8 << 20))
    second = warm.start()
    try:
        assert attach(second, "m-padded") == (gid, False), second.log[-3000:]
        lines = [line for line in second.log.splitlines() if "larger than its bound" in line]
        assert len(lines) == 1 and str(journal) in lines[0], second.log[-3000:]
        assert not journal.exists(), "consumed (refused) like any unusable journal"
    finally:
        second.stop()
