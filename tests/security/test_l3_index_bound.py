"""A stranger's many small pages and the file L3's in-memory index (``l3.file.max_pages``).

The file backend keeps every stored page's key in memory. Only bytes bounded it before, so a
byte-only client (no fd handoff needed) writing pages with new keys grew the daemon by one
index entry per 1 KiB slot of ``l3.file.capacity_bytes`` (a review measured +324 MiB in 30 s,
16.8 M entries reachable at the defaults), outside ``host.budget`` and every limit. Now the
store holds at most ``l3.file.max_pages`` pages; the oldest go first, as for bytes.
"""

from __future__ import annotations

from pathlib import Path

from hicached_client import HiCacheClient, PageBytes

from tests.daemon.conftest import start_file_daemon
from tests.robustness.loop_support import PAGE_BYTES, attach_bytes

MAX_PAGES = 32


def test_pages_past_max_pages_evict_the_oldest_and_the_index_stays_bounded(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    daemon = start_file_daemon(l3, "--set", f"l3.file.max_pages={MAX_PAGES}")
    try:
        with HiCacheClient(daemon.target, timeout_s=60.0) as client:
            session = attach_bytes(client, "m-l3-index")
            for batch in range(4):  # one batch after another reaches L3 (oldest first)
                assert session.put_bytes(pages_of(batch)).stored_pages == MAX_PAGES
                keys = [p.key for p in pages_of(batch)]
                assert session.backup(keys, wait=True).shortfall == ""
            (backend,) = client.get_stats().backends
            assert (backend.name, backend.pages, backend.bytes) == ("file", MAX_PAGES, MAX_PAGES * PAGE_BYTES)
    finally:
        daemon.stop()
    # A new daemon on the same directory (empty L2): the newest batch is what L3 kept.
    daemon = start_file_daemon(l3, "--set", f"l3.file.max_pages={MAX_PAGES}")
    try:
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            session = attach_bytes(client, "m-l3-index")
            newest = session.get_bytes([p.key for p in pages_of(3)], include_l3=True)
            assert [p.data for p in newest.pages] == [p.data for p in pages_of(3)]
            assert not session.get_bytes([p.key for p in pages_of(0)], include_l3=True).pages
    finally:
        daemon.stop()


def pages_of(batch: int) -> list[PageBytes]:
    return [PageBytes(f"s{batch}-{i}", "kv", bytes([batch, i]) * (PAGE_BYTES // 2)) for i in range(MAX_PAGES)]
