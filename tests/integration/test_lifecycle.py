"""Issue 3 acceptance: a killed worker leaks nothing; sessions cannot touch each other's pages."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Stats, Transfer, WorkerIdentity

from tests.support.daemon import LEASE_MS, Daemon
from tests.support.kv import WorkerPools, transfers, unique_tag
from tests.support.state import poll, state
from tests.support.workers import read_report, spawn_worker


def _unlink_segments(tag: str) -> None:
    for seg in Path("/dev/shm").glob(f"hct-{tag}-*"):
        with contextlib.suppress(FileNotFoundError):
            seg.unlink()


def _group_pools(stats: Stats, group: str) -> dict[str, tuple[int, int]]:
    return {p.name: (p.free_pages, p.total_pages) for g in stats.groups if g.group == group for p in g.pools}


def test_worker_killed_mid_write_leaves_no_page_allocated(daemon: Daemon, admin: HiCacheClient) -> None:
    proc, tag = spawn_worker(daemon, "hold_and_write", model="m-kill", pages=128, seed=21)
    try:
        hello = read_report(proc)
        assert hello["held"] and hello["first"]
        session_id, group = hello["session_id"], hello["group"]
        info = admin.get_stats().session(session_id)
        assert info is not None and info.owned_pages >= 64, "the worker holds pages when it is killed"
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _unlink_segments(tag)

    def released(stats: Stats) -> bool:
        pools = _group_pools(stats, group)
        return stats.session(session_id) is None and all(free == total for free, total in pools.values())

    stats = poll(
        admin.get_stats, released, timeout_s=10 * LEASE_MS / 1000, what="lease expiry of the killed worker"
    )
    # The lease, not the kill, ended the session: it lived at least most of a lease after the kill.
    assert time.monotonic() - killed_at >= 0.5 * LEASE_MS / 1000
    assert stats.session(session_id) is None
    for name, (free, total) in _group_pools(stats, group).items():
        assert free == total, f"pool {name}: {total - free} pages leaked"


def _expect_denied(call: Callable[[], Any], what: str, code: grpc.StatusCode) -> HiCacheError:
    with pytest.raises(HiCacheError) as info:
        call()
    assert info.value.code == code, (what, info.value)
    return info.value


def test_sessions_cannot_touch_each_others_pages_or_backups(
    daemon: Daemon, client: HiCacheClient, admin: HiCacheClient
) -> None:
    proc, tag = spawn_worker(daemon, "owner", model="m-iso", pages=32, seed=31)
    pools_b = WorkerPools.create(unique_tag("iso-b"))
    try:
        a = read_report(proc)
        identity = WorkerIdentity(unique_tag("iso-b"), generation=1, model_name="m-iso")
        with client.attach(identity, pools_b.specs()) as b:
            assert b.info.joined_existing_group, "same model and layout: one shared pool group"
            host = a["host"]
            dev = list(range(len(host["kv"])))
            keys = [f"{i:064x}" for i in range(len(dev))]
            cases: dict[str, Callable[[], Any]] = {
                "Free": lambda: b.free("kv", host["kv"]),
                "Load": lambda: b.load_wait(transfers(dev, host)),
                "Write": lambda: b.write(transfers(dev, host)),
                "ReleaseTransfers": lambda: b.release_transfers(
                    [Transfer(p, dev, host[p], host_allocated=True) for p in ("draft", "kv")]
                ),
                "Publish": lambda: b.publish(keys, [Transfer(p, [], host[p]) for p in ("draft", "kv")]),
                "RetractRestore": lambda: b.retract_restore_wait(a["backup_id"], transfers(dev[:16])),
                "RetractDiscard": lambda: b.retract_discard(a["backup_id"]),
            }
            no_such_id = "0" * len(a["backup_id"])
            unknown_backup: dict[str, Callable[[], Any]] = {
                "RetractRestore": lambda: b.retract_restore_wait(no_such_id, transfers(dev[:16])),
                "RetractDiscard": lambda: b.retract_discard(no_such_id),
            }
            before = state(admin)
            for name, call in cases.items():
                if name.startswith("Retract"):
                    # Another session's backup reads as an unknown one, in the same words: a
                    # stranger holding a leaked id learns nothing, not even that it exists.
                    err = _expect_denied(call, name, grpc.StatusCode.NOT_FOUND)
                    unknown = _expect_denied(unknown_backup[name], name, grpc.StatusCode.NOT_FOUND)
                    assert err.message.replace(a["backup_id"], no_such_id) == unknown.message, name
                else:
                    err = _expect_denied(call, name, grpc.StatusCode.PERMISSION_DENIED)
                    assert b.session_id in err.message, (name, err.message)
                assert state(admin) == before, f"{name} changed daemon state"
        assert proc.stdin is not None
        proc.stdin.write("verify\n")
        proc.stdin.flush()
        final = read_report(proc)
        assert final["pages_intact"] == {"kv": True, "draft": True}
        assert final["backup_intact"] == {"kv": True, "draft": True}
        assert final["released"] == 2 * len(host["kv"])
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pools_b.close()
        _unlink_segments(tag)


def test_a_new_generation_replaces_the_old_session_and_frees_its_pages(
    client: HiCacheClient, admin: HiCacheClient
) -> None:
    pools = WorkerPools.create(unique_tag("gen"))
    instance = unique_tag("gen")
    try:
        old = client.attach(WorkerIdentity(instance, generation=1, model_name="m-gen"), pools.specs())
        info = old.stats().session(old.session_id)
        assert info is not None
        free_before = _group_pools(admin.get_stats(), info.group)
        assert old.alloc("kv", 16).ok and old.write(transfers([1, 2]), allocate=True).ok
        new = client.attach(WorkerIdentity(instance, generation=2, model_name="m-gen"), pools.specs())
        with new:
            assert new.info.replaced_session_id == old.session_id
            assert _group_pools(admin.get_stats(), info.group) == free_before, "the replaced session's pages"
            with pytest.raises(HiCacheError) as gone:
                old.alloc("kv", 1)
            assert gone.value.code == grpc.StatusCode.NOT_FOUND and old.session_id in gone.value.message
            poll(lambda: old.heartbeat_running, lambda running: not running, 10, "old heartbeat stopping")
            assert old.lease_lost is not None and old.lease_lost.code == grpc.StatusCode.NOT_FOUND
            with pytest.raises(HiCacheError) as stale:
                client.attach(WorkerIdentity(instance, generation=1, model_name="m-gen"), pools.specs())
            assert stale.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "generation" in stale.value.message
        old.close()  # already ended by the daemon: not an error
    finally:
        pools.close()
