"""Issue 3 acceptance: byte-exact write/load and retraction round trips in worker processes."""

from __future__ import annotations

from tests.support.daemon import Daemon
from tests.support.kv import DRAFT_DIM, DRAFT_HEADS, DRAFT_LAYERS, KV_DIM, KV_HEADS, KV_LAYERS, PAGE_SIZE
from tests.support.workers import run_worker

PAGES = 256
KV_PAGE_BYTES = PAGE_SIZE * KV_LAYERS * 2 * KV_HEADS * KV_DIM * 2  # K and V, float16
DRAFT_PAGE_BYTES = PAGE_SIZE * DRAFT_LAYERS * 2 * DRAFT_HEADS * DRAFT_DIM * 2  # bfloat16


def test_write_then_load_into_different_slots_is_byte_exact(daemon: Daemon) -> None:
    r = run_worker(daemon, "roundtrip", model="m-roundtrip", pages=PAGES, seed=11)
    assert r["ok"]
    assert r["actual"] == r["expected"]
    assert r["untouched"] == {"kv": True, "draft": True}, "load wrote outside its destination slots"
    assert r["layers"] == sorted(r["layers"]) and set(r["layers"]) >= {0, 1}
    assert r["host_allocated"] == {"kv": True, "draft": True}
    assert r["write_acks"] == {
        "kv": [PAGES, PAGES * PAGE_SIZE, PAGES * KV_PAGE_BYTES],
        "draft": [PAGES, PAGES * PAGE_SIZE, PAGES * DRAFT_PAGE_BYTES],
    }
    assert r["load_acks"] == r["write_acks"]
    assert {p: r["free_before"][p] - r["free_written"][p] for p in ("kv", "draft")} == {
        "kv": PAGES,
        "draft": PAGES,
    }
    assert r["released"] == 2 * PAGES
    assert r["free_after"] == r["free_before"]


def test_retraction_backup_restore_is_byte_exact_and_returns_host_room(daemon: Daemon) -> None:
    r = run_worker(daemon, "retract", model="m-retract", pages=PAGES, seed=12)
    assert r["ok"]
    assert r["listed"] == [2 * PAGES], "GetStats lists the backup with its pages"
    assert {p: r["free_before"][p] - r["free_backed_up"][p] for p in ("kv", "draft")} == {
        "kv": PAGES,
        "draft": PAGES,
    }
    assert r["actual"] == r["expected"]
    assert r["untouched"] == {"kv": True, "draft": True}
    assert r["free_after"] == r["free_before"]
    assert r["backup_id"] not in r["backups_after"]


def test_backup_without_host_room_is_declined_and_changes_nothing(daemon: Daemon) -> None:
    r = run_worker(daemon, "decline", model="m-decline", pages=64, room=8, seed=13)
    assert r["free_held"]["kv"] == 8
    assert not r["backup_ok"] and r["backup_id"] == ""
    assert r["free_after_backup"] == r["free_held"], "a declined backup left pages allocated"
    assert not r["write_ok"]
    assert r["free_after_write"] == r["free_held"], "a declined write left pages allocated"
    assert r["backups"] == 0
    assert r["freed"] == r["total"]["kv"] - 8
    assert r["free_end"] == r["total"]
