"""Crash hygiene of host segments: a SIGKILLed daemon's shared memory is reclaimed at the next
start of a daemon with the same ``host.shm_prefix`` (its ownership record proves it dead), in cold
mode, with the names and bytes logged; a daemon of another prefix is never touched.

Real daemon subprocesses, real /dev/shm.
"""

from __future__ import annotations

import contextlib
import re
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hicached_client import HiCacheClient, WorkerIdentity

from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import WorkerPools, transfers, unique_tag

TIMEOUT_S = 30.0
SHM = Path("/dev/shm")


def segments(prefix: str) -> dict[str, int]:
    """Host segments (not ownership records) of ``prefix``: name -> bytes."""
    return {p.name: p.stat().st_size for p in SHM.glob(f"{prefix}-*") if not p.name.endswith(".owner")}


@pytest.fixture
def pools() -> Iterator[WorkerPools]:
    p = WorkerPools.create(unique_tag("crash"))
    try:
        yield p
    finally:
        p.close()


def hold_pages(daemon: Daemon, pools: WorkerPools) -> None:
    """Attach and write pages that stay allocated (the session is never detached)."""
    client = HiCacheClient(daemon.target, timeout_s=TIMEOUT_S)
    session = client.attach(
        WorkerIdentity(unique_tag("w"), generation=1, model_name="m-crash"), pools.specs()
    )
    assert session.write(transfers(range(8)), allocate=True).ok
    client.close()


def test_sigkilled_daemon_segments_are_reclaimed_at_the_next_start(pools: WorkerPools) -> None:
    """Fails before the fix: with warm restart off nothing ever removed a killed daemon's
    ``{prefix}-{daemon id}-...`` segments (10 kills left 2 GB in /dev/shm)."""
    prefix = f"hccr{uuid.uuid4().hex[:8]}"
    other_prefix = f"{prefix}x"  # starts like ours: must still never be touched
    victim = start_daemon("--set", f"host.shm_prefix={prefix}")
    bystander = start_daemon("--set", f"host.shm_prefix={other_prefix}")
    successor: Daemon | None = None
    try:
        hold_pages(victim, pools)
        hold_pages(bystander, pools)
        left = segments(prefix)
        theirs = segments(other_prefix)
        assert left and theirs, "both daemons created host segments"

        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(timeout=TIMEOUT_S)
        assert segments(prefix) == left, "a SIGKILL leaves the segments behind"

        successor = start_daemon("--set", f"host.shm_prefix={prefix}")
        assert segments(prefix) == {}, f"segments of the dead daemon left: {segments(prefix)}"
        assert segments(other_prefix) == theirs, "a live daemon of another prefix lost segments"
        log = successor.log
        assert re.search(rf"reclaimed {len(left)} host segment\(s\), {sum(left.values())} bytes", log), log
        for name, size in left.items():
            assert f"{name} ({size} bytes)" in log

        # The bystander still serves its session's pages, and the successor serves too.
        hold_pages(bystander, pools)
        hold_pages(successor, pools)
    finally:
        for d in (successor, bystander, victim):
            if d is not None:
                d.stop()
        for seg in (*SHM.glob(f"{prefix}*"), *SHM.glob(f"{other_prefix}*")):
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()


def test_a_live_daemon_of_the_same_prefix_keeps_its_segments(pools: WorkerPools) -> None:
    """The ownership record is a held lock, not a guess: a second daemon of the same prefix
    starting beside a live one frees nothing of it (and after a clean stop nothing is left)."""
    prefix = f"hccl{uuid.uuid4().hex[:8]}"
    first = start_daemon("--set", f"host.shm_prefix={prefix}")
    second: Daemon | None = None
    try:
        hold_pages(first, pools)
        held = segments(prefix)
        second = start_daemon("--set", f"host.shm_prefix={prefix}")
        assert segments(prefix) == held
        assert "reclaimed" not in second.log
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=TIMEOUT_S) == 0
        assert segments(prefix) == {}, "a clean stop leaves no segment"
        records = list(SHM.glob(f"{prefix}-*.owner"))
        assert len(records) == 1, f"only the live daemon's record is left: {records}"
    finally:
        for d in (second, first):
            if d is not None:
                d.stop()
        for seg in SHM.glob(f"{prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
